"""The real agent's ``attest`` (busybox sh, tpm2-tools) against a real metald and a real TPM
(swtpm with an EK certificate from swtpm_setup): it makes and enrolls the AK, quotes over
metald's nonce and sends the event log; enrollment activates metald's credential in the TPM and
happens once; the first verdict learns, the next boot passes, and a
PCR the log does not account for is refused.

swtpm here has no firmware in front of it: nothing is measured, so its event log is the
crypto-agile header alone (taken from the OVMF fixture), which replays to all-zero PCRs. The
OVMF half (a real measured boot) is tests/attestation/test_verify.py's fixtures."""

from __future__ import annotations

import shutil
import socket
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from metald.enrollment import mint_agent_token
from metald.lifecycle import State
from metald.machines import get_machine
from metald.store.models import Attestation, AttestationKey, Machine
from tests.api_helpers import LoopbackApi
from tests.attestation.test_verify import read

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "bootassets" / "agent" / "metald-agent"
BUSYBOX = shutil.which("busybox")
NEEDED = ("busybox", "swtpm", "swtpm_setup", "tpm2")
pytestmark = pytest.mark.skipif(
    any(shutil.which(t) is None for t in NEEDED), reason=f"needs {', '.join(NEEDED)}"
)


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        if port < 65000:
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two free ports in a row")


@pytest.fixture
def tpm(tmp_path: Path) -> Iterator[str]:
    """A swtpm with an EK certificate, on TCP: its TCTI string. Stopped after the test."""
    state = tmp_path / "tpm"
    state.mkdir()
    subprocess.run(
        ["swtpm_setup", "--tpm2", "--tpmstate", str(state), "--create-ek-cert",
         "--overwrite", "--pcr-banks", "sha256"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    port = _free_port_pair()
    proc = subprocess.Popen(
        ["swtpm", "socket", "--tpm2", "--tpmstate", f"dir={state}",
         "--server", f"type=tcp,port={port},bindaddr=127.0.0.1",
         "--ctrl", f"type=tcp,port={port + 1},bindaddr=127.0.0.1",
         "--flags", "not-need-init,startup-clear"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    tcti = f"swtpm:host=127.0.0.1,port={port}"
    try:
        for _ in range(200):  # until it answers (a poll with a deadline, not a sleep)
            if subprocess.run(
                ["tpm2", "getcap", "properties-fixed"],
                env={"TPM2TOOLS_TCTI": tcti}, capture_output=True, check=False,
            ).returncode == 0:  # fmt: skip
                break
        else:
            raise RuntimeError("swtpm did not answer")
        yield tcti
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def live(db_url: str, tmp_path: Path) -> Iterator[LoopbackApi]:
    with LoopbackApi(db_url, tmp_path) as api:
        yield api


def _header_only_log(tmp_path: Path) -> Path:
    log = read("a-boot1.eventlog")
    size = 32 + struct.unpack("<I", log[28:32])[0]  # TCG_PCR_EVENT: ..., eventSize, event
    out = tmp_path / "eventlog"
    out.write_bytes(log[:size])
    return out


def _tools(tmp_path: Path) -> Path:
    assert BUSYBOX
    d = tmp_path / "tools"
    d.mkdir()
    for applet in subprocess.run(
        [BUSYBOX, "--list"], capture_output=True, text=True, check=True
    ).stdout.split():
        (d / applet).symlink_to(BUSYBOX)
    (d / "tpm2").symlink_to(shutil.which("tpm2") or "tpm2")
    return d


def _boot(api: LoopbackApi, mid: str, state: State, boot: str) -> str:
    with api.store.session() as s:
        m = get_machine(s, mid)
        m.state, m.boot_armed = state.value, boot
        s.add(m)
        s.commit()
        token = mint_agent_token(s, get_machine(s, mid), actor="test", ttl_s=600)
        assert token is not None
        return token


def _attest(api: LoopbackApi, tmp_path: Path, token: str, tcti: str, log: Path, kind: str) -> str:
    env = {
        "PATH": str(tmp_path / "tools"),
        "METALD_STATE_DIR": str(tmp_path / "state"),
        "METALD_AGENT_LIB": "1",
        "METALD_TPM_TCTI": tcti,
        "METALD_EVENT_LOG": str(log),
    }
    script = f'. {AGENT}; URL={api.base}; TOKEN={token}; mkdir -p "$STATE"; attest {kind}'
    done = subprocess.run(
        [BUSYBOX or "busybox", "sh", "-c", script],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stderr


def _statuses(api: LoopbackApi, mid: str) -> list[tuple[str, str | None]]:
    with api.store.session() as s:
        rows = s.exec(
            Attestation.__table__.select()  # type: ignore[attr-defined]
            .where(Attestation.machine_id == mid)
            .order_by(Attestation.at)
        ).all()
        return [(r.status, r.reason) for r in rows]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the agent, not the store
def test_the_agent_enrolls_quotes_and_is_judged(
    live: LoopbackApi, tmp_path: Path, tpm: str
) -> None:
    _tools(tmp_path)
    log = _header_only_log(tmp_path)
    with live.store.session() as s:
        m = Machine(state=State.DISCOVERED.value)
        s.add(m)
        s.commit()
        mid = m.id

    out = _attest(live, tmp_path, _boot(live, mid, State.INSPECTING, "b1"), tpm, log, "discovery")
    assert "attestation: learned" in out, out
    assert "measured boot: key enrolled" in out, out
    with live.store.session() as s:
        key = s.get(AttestationKey, mid)
        assert key is not None
        assert key.ek_check.startswith("EK certificate matches the EK"), key.ek_check
        # Enrolled through credential activation in the swtpm (tpm2_activatecredential).
        assert key.ek_check.endswith("AK bound to the EK by credential activation")

    # The next discovery boot: the same AK (kept in the TPM), the same measurements; metald
    # holds the AK, so the agent neither re-reads nor re-sends key material (fails on the old
    # agent, which enrolled in every discovery boot).
    out = _attest(live, tmp_path, _boot(live, mid, State.INSPECTING, "b2"), tpm, log, "discovery")
    assert "attestation: passed" in out, out
    assert "key enrolled" not in out and "attestation key" not in out, out

    # The wipe boot, with a PCR the event log does not explain: refused, and the wipe's end
    # would hold the machine (no passing attestation in this boot).
    subprocess.run(
        ["tpm2", "pcrextend", "1:sha256=" + "11" * 32],
        env={"TPM2TOOLS_TCTI": tpm}, check=True, capture_output=True,
    )  # fmt: skip
    out = _attest(live, tmp_path, _boot(live, mid, State.WIPING, "b3"), tpm, log, "wipe")
    assert "attestation: refused forged-event-log" in out, out
    assert _statuses(live, mid) == [
        ("learned", None),
        ("passed", None),
        ("refused", "forged-event-log"),
    ]
