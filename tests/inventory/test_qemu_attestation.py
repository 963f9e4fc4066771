"""Lab (METALD_LAB_LONG=1): the built discovery image under OVMF measured boot with swtpm as the
machine's TPM (QEMU ``tpm-tis``). The agent makes and sends its attestation key, quotes over
the stand-in's nonce and sends the real UEFI event log; metald's verification core accepts it
(trust on first use), and the console's uptime stamps give what attestation cost the boot."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from metald.attestation import eventlog
from metald.attestation.verify import verify
from tests.inventory.conftest import ROOT
from tests.qemu_netns import QEMU_IN_NETNS, bridge_netns, metald_standin, run_guest, tap_nic

OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
pytestmark = [
    *QEMU_IN_NETNS,
    pytest.mark.skipif(
        shutil.which("swtpm") is None or not OVMF_CODE.exists(), reason="needs swtpm, ovmf"
    ),
    pytest.mark.skipif(
        os.environ.get("METALD_LAB_LONG") != "1",
        reason="an OVMF boot of the discovery image under TCG (~1 min): METALD_LAB_LONG=1",
    ),
]
SERVER = "10.77.1.1"
PORT = 8080
MAC = "52:54:00:6d:65:01"


@pytest.fixture
def netns() -> Iterator[str]:
    with bridge_netns(f"mdatt{os.getpid()}", SERVER, ("tap0",)) as name:
        yield name


@pytest.fixture
def swtpm(tmp_path: Path) -> Iterator[Callable[[], Path]]:
    """A TPM with an EK certificate (swtpm_setup), kept across boots: each call starts swtpm
    on its state for one QEMU run (it ends when QEMU lets go) and gives the socket's path."""
    state = tmp_path / "tpm"
    state.mkdir()
    subprocess.run(
        ["swtpm_setup", "--tpm2", "--tpmstate", str(state), "--create-ek-cert", "--overwrite",
         "--pcr-banks", "sha256"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> Path:
        sock = tmp_path / f"swtpm{len(procs)}.sock"
        procs.append(
            subprocess.Popen(
                [
                    "swtpm",
                    "socket",
                    "--tpm2",
                    "--tpmstate",
                    f"dir={state}",
                    "--ctrl",
                    f"type=unixio,path={sock}",
                    "--terminate",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
        )
        return sock

    try:
        yield start
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def _uptime(log: str, marker: str) -> float:
    line = next(li for li in log.splitlines() if marker in li)
    m = re.search(r"metald-agent: \[([0-9.]+)\]", line)
    assert m, line
    return float(m.group(1))


@pytest.mark.parametrize("tpm_device", ["tpm-tis", "tpm-crb"])
def test_discovery_boot_attests_under_ovmf_measured_boot(
    built_assets, netns, swtpm, tmp_path, tpm_device
):
    """Both TPM interfaces QEMU offers: TIS (a FIFO of registers, each access a trap under
    TCG) and CRB (a command buffer in memory: what firmware TPMs such as Intel PTT use)."""
    receiver = ROOT / "tests/inventory/receiver.py"
    vars_copy = tmp_path / "vars.fd"
    shutil.copyfile(OVMF_VARS, vars_copy)
    posts = tmp_path / "posts.jsonl"
    logs = []
    with metald_standin(netns, tmp_path, receiver, SERVER, PORT, posts):
        disc = built_assets / "discovery"
        for boot in (1, 2):  # the first boot makes the EK and AK; the second finds them
            console = tmp_path / f"console{boot}.log"
            qemu = [
                "qemu-system-x86_64", "-accel", "tcg", "-machine", "q35", "-m", "512", "-smp", "2",
                "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}",
                "-drive", f"if=pflash,format=raw,unit=1,file={vars_copy}",
                "-chardev", f"socket,id=chrtpm,path={swtpm()}",
                "-tpmdev", "emulator,id=tpm0,chardev=chrtpm", "-device", f"{tpm_device},tpmdev=tpm0",
                "-kernel", str(disc / "vmlinuz"), "-initrd", str(disc / "initrd.img"),
                "-append", f"console=ttyS0 quiet no_timer_check metald.url=http://{SERVER}:{PORT} metald.token=agent-token metald.machine=lab-1",
                "-display", "none", "-monitor", "none", "-serial", f"file:{console}", "-no-reboot",
                *tap_nic(MAC, "tap0"),
            ]  # fmt: skip
            rc, log = run_guest(netns, qemu, tmp_path, console, timeout=300)
            assert rc == 0, (tmp_path / "qemu.log").read_text()
            assert "] attestation: recorded" in log, log
            assert "] inventory posted (" in log, log
            logs.append(log)
    calls = [
        json.loads(line)
        for line in posts.with_suffix(".attestation.jsonl").read_text().splitlines()
    ]
    # The first boot enrolls (challenge, activated secret back); the second boot's TPM holds
    # the AK metald names in the nonce's answer, so it only quotes.
    assert [c["kind"] for c in calls] == [
        "attestation/nonce", "attestation/key", "attestation/key", "attestation",
        "attestation/nonce", "attestation",
    ]  # fmt: skip
    assert calls[2]["answer"]["status"] == "enrolled", calls[2]["answer"]
    assert calls[4]["answer"]["ak_name"] == calls[2]["answer"]["ak_name"]
    key = calls[1]["body"]
    assert key["ek_public"].startswith("-----BEGIN PUBLIC KEY-----")
    assert key.get("ek_certificate")  # swtpm_setup's EK certificate, read from NV
    golden = None
    for nonce_call, quote_call in ((calls[0], calls[3]), (calls[4], calls[5])):
        quote = quote_call["body"]
        nonce = nonce_call["answer"]["nonce"]
        assert quote["nonce"] == nonce
        raw = {k: base64.b64decode(quote[k]) for k in ("quote", "signature", "event_log")}
        verdict = verify(
            attestation_key=base64.b64decode(key["ak_public"]),
            quote=raw["quote"],
            signature=raw["signature"],
            event_log=raw["event_log"],
            nonce=bytes.fromhex(nonce),
            golden=golden,
            pcrs=(0, 1, 2, 3, 5, 6, 7),
        )
        # The first boot teaches the golden values; the second boot measures the same.
        assert verdict.status == ("learned" if golden is None else "passed"), verdict.summary()
        golden = verdict.golden
        labels = {e.label for e in eventlog.parse(raw["event_log"]).events}
        assert {"SecureBoot", "BootOrder"} <= labels  # OVMF's measurements, really
    for boot, log in enumerate(logs, 1):
        cost = _uptime(log, "attestation: recorded") - _uptime(log, "measured boot: attesting")
        # The agent attests beside the inventory's collection: what the boot waits for is the
        # part of the attestation that outlasts the collection.
        added = max(
            0.0, _uptime(log, "attestation: recorded") - _uptime(log, "inventory collected")
        )
        print(f"\n{tpm_device} discovery boot {boot}: attestation {cost:.2f} s, of which the boot waits "
              f"{added:.2f} s (collection {_uptime(log, 'inventory collected') - _uptime(log, 'collecting inventory'):.2f} s)")  # fmt: skip
        what = "EK and AK made and persisted" if boot == 1 else "EK and AK found in the TPM"
        steps = [li.split("] ", 1)[-1] for li in log.splitlines() if "measured boot:" in li]
        stamps = [_uptime(log, st) for st in steps]
        print(f"\nattestation in discovery boot {boot} ({what}): {cost:.2f} s; steps: "
              + ", ".join(f"{st} at {at:.2f}" for st, at in zip(steps, stamps, strict=True)))  # fmt: skip
