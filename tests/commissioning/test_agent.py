"""The real discovery agent (busybox sh) runs the commissioning checks against a real metald
on loopback. The GPU tools are stand-ins that print captured output (the real A100 capture,
and failure cases derived from it by labelled edits): no real GPU ran these checks here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from metald import enrollment, machines, metrics
from metald.commissioning.profile import CheckSpec, CommissioningProfile
from metald.config import EnrollConfig
from metald.inventory.rules import EnrollmentRule
from metald.lifecycle import Trigger
from metald.store.models import CommissioningRun, Machine
from tests.api_helpers import LoopbackApi
from tests.test_enrollment import MAC, payload

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "bootassets" / "agent" / "metald-agent"
COMMISSION = ROOT / "bootassets" / "agent" / "metald-commission"
BUSYBOX = shutil.which("busybox")
A100_XML = Path("/work/shared/fixtures/gpu/nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml")
pytestmark = [
    pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed"),
    pytest.mark.skipif(not A100_XML.exists(), reason="shared GPU fixtures absent"),
]
XID_79 = "[  912.1] NVRM: Xid (PCI:0000:01:00): 79, pid=0, GPU has fallen off the bus.\n"


def whole_a100() -> str:
    """DERIVED from the real capture: attached_gpus 4 -> 1 (upstream cut 3 GPUs out)."""
    return A100_XML.read_text().replace(
        "<attached_gpus>4</attached_gpus>", "<attached_gpus>1</attached_gpus>"
    )


def x8_a100() -> str:
    """DERIVED: current link width 16x -> 8x."""
    return whole_a100().replace(
        "<current_link_width>16x</current_link_width>",
        "<current_link_width>8x</current_link_width>",
    )


def ecc_a100() -> str:
    """DERIVED: volatile and aggregate DRAM uncorrectable 0 -> 3."""
    return whole_a100().replace(
        "<dram_uncorrectable>0</dram_uncorrectable>", "<dram_uncorrectable>3</dram_uncorrectable>"
    )


PROFILE = CommissioningProfile(
    name="a100-intake",
    checks=[
        CheckSpec(name="nvidia-smi", timeout_s=30),
        CheckSpec(name="xid", timeout_s=30),
        CheckSpec(name="ib", timeout_s=30),
    ],
)


@pytest.fixture
def live(db_url: str, tmp_path: Path) -> Iterator[LoopbackApi]:
    def prepare(cfg, store, tokens) -> None:  # type: ignore[no-untyped-def]
        cfg.enroll = EnrollConfig(rules=[EnrollmentRule(commissioning=PROFILE)])

    with LoopbackApi(db_url, tmp_path, prepare) as api:
        yield api


def _commissioning_machine(api: LoopbackApi) -> tuple[str, str]:
    """A machine that posted its inventory and is commissioning; its agent token."""
    with api.store.session() as s:
        m = machines.create_machine(s, macs=[MAC], actor="t")
        m = machines.transition(s, m.id, Trigger.INSPECT, actor="t")
        token = enrollment.mint_agent_token(s, m, actor="t", ttl_s=600)
        assert token
        enrollment.accept_inventory(
            s,
            m.id,
            payload(m.id, boot_id="0f1e2d3c-4b5a-4678-9abc-def012345678"),
            actor="agent",
            cfg=EnrollConfig(rules=[EnrollmentRule(commissioning=PROFILE)]),
        )
        assert s.get(Machine, m.id).state == "commissioning"  # type: ignore[union-attr]
        return m.id, token


def _tools(tmp_path: Path, *, smi: str, dmesg: str, hang: bool = False) -> Path:
    """busybox applets plus stand-in nvidia-smi and dmesg that print the given output."""
    assert BUSYBOX
    d = tmp_path / "tools"
    d.mkdir()
    for applet in subprocess.run(
        [BUSYBOX, "--list"], capture_output=True, text=True, check=True
    ).stdout.split():
        (d / applet).symlink_to(BUSYBOX)
    (tmp_path / "smi.out").write_text(smi)
    sysroot = tmp_path / "sysroot"
    sysroot.mkdir()
    (sysroot / "dmesg").write_text(dmesg)  # the kernel log, as the agent reads it from a tree
    body = "exec sleep 600" if hang else f"exec cat {tmp_path / 'smi.out'}"
    (d / "nvidia-smi").write_text(f"#!{BUSYBOX} sh\n{body}\n")
    (d / "nvidia-smi").chmod(0o755)
    return d


def _run_agent(
    api: LoopbackApi,
    tmp_path: Path,
    token: str,
    tools: Path,
    then: str = "follow_instructions",
) -> str:
    """The agent's instruction loop (its inventory was posted; or ``then`` posts it first):
    commission, then power off."""
    sysroot = tmp_path / "sysroot"
    (sysroot / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1").mkdir(parents=True)
    port = sysroot / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    env = {
        "PATH": str(tools),
        "METALD_URL": api.base,
        "METALD_TOKEN": token,
        "METALD_SYSROOT": str(sysroot),
        "METALD_STATE_DIR": str(tmp_path / "state"),
        "METALD_DRY_RUN": "1",
        "METALD_MAX_TRIES": "2",
        "METALD_RETRY_MAX": "1",
        "METALD_COMMISSION": str(COMMISSION),
        "METALD_AGENT_LIB": "1",
    }
    script = f'. {AGENT}; URL="$METALD_URL"; TOKEN="$METALD_TOKEN"; mkdir -p "$STATE"; {then}'
    done = subprocess.run(
        [BUSYBOX, "sh", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def _outcome(api: LoopbackApi, mid: str) -> tuple[str, CommissioningRun]:
    with api.store.session() as s:
        m = s.get(Machine, mid)
        run = s.exec(
            CommissioningRun.__table__.select().where(  # type: ignore[attr-defined]
                CommissioningRun.machine_id == mid
            )
        ).first()
        return m.state, run  # type: ignore[union-attr,return-value]


def test_healthy_gpu_passes_through_the_real_agent(live: LoopbackApi, tmp_path: Path) -> None:
    mid, token = _commissioning_machine(live)
    log = _run_agent(live, tmp_path, token, _tools(tmp_path, smi=whole_a100(), dmesg="boot\n"))
    state, run = _outcome(live, mid)
    assert (state, run.status) == ("ready", "passed"), log
    assert "dry run: would poweroff" in log
    assert "commissioning plan received with the instruction" in log  # in next's answer


def _asked(path: str) -> float:
    return metrics.api_requests.labels("GET", path, "200")._value.get()


def test_the_agent_starts_its_checks_from_the_inventory_answer(
    live: LoopbackApi, tmp_path: Path
) -> None:
    """The inventory post's answer says commission and carries the plan: the agent asks
    metald nothing before its first check (it used to ask next, then the plan: two more waits
    in a storm's queue)."""
    with live.store.session() as s:
        m = machines.create_machine(s, macs=[MAC], actor="t")
        m = machines.transition(s, m.id, Trigger.INSPECT, actor="t")
        token = enrollment.mint_agent_token(s, m, actor="t", ttl_s=600)
    assert token
    boot = "0f1e2d3c-4b5a-4678-9abc-def012345678"
    body = payload(m.id, boot_id=boot)
    head = ("schema_version", "agent_version", "machine_id", "boot_id", "sequence")
    (tmp_path / "state").mkdir(exist_ok=True)
    (tmp_path / "state" / "inventory.part").write_text(
        json.dumps({k: v for k, v in body.items() if k not in head})[1:]
    )
    tools = _tools(tmp_path, smi=whole_a100(), dmesg="boot\n")
    rnd = tmp_path / "sysroot" / "proc" / "sys" / "kernel" / "random"
    rnd.mkdir(parents=True)
    (rnd / "boot_id").write_text(boot + "\n")
    before = _asked("/api/v1/agent/next"), _asked("/api/v1/agent/commissioning")
    log = _run_agent(
        live, tmp_path, token, tools, then=f"MACHINE={m.id}; post_inventory && follow_instructions"
    )
    state, run = _outcome(live, mid=m.id)
    assert (state, run.status) == ("ready", "passed"), log
    assert "commissioning plan received with the instruction" in log
    # Only the question after the verdict (ready: power off); never the plan's endpoint.
    after = _asked("/api/v1/agent/next"), _asked("/api/v1/agent/commissioning")
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0), log


@pytest.mark.parametrize(
    ("smi", "dmesg", "sentence"),
    [
        (x8_a100, "", "nvidia-smi: GPU 00000000:01:00.0 PCIe link at x8, below its maximum x16"),
        (
            ecc_a100,
            "",
            "nvidia-smi: GPU 00000000:01:00.0 has 3 uncorrectable ECC errors since "
            "the driver loaded",
        ),
        (whole_a100, XID_79, "xid: XID 79 on GPU 0000:01:00 (pid=0, GPU has fallen off the bus.)"),
        # The real capture as published: its header counts 4 GPUs, it describes 1.
        (
            lambda: A100_XML.read_text(),
            "",
            "nvidia-smi: nvidia-smi reports 4 attached GPUs but describes 1",
        ),
    ],
    ids=["pcie-x8", "ecc-uncorrectable", "xid-79", "missing-gpu"],
)
def test_gpu_failures_fail_with_the_right_sentence(  # type: ignore[no-untyped-def]
    live: LoopbackApi, tmp_path: Path, smi, dmesg: str, sentence: str
) -> None:
    mid, token = _commissioning_machine(live)
    log = _run_agent(live, tmp_path, token, _tools(tmp_path, smi=smi(), dmesg=dmesg))
    state, run = _outcome(live, mid)
    assert (state, run.status) == ("commission-failed", "failed"), log
    assert run.summary == sentence


def test_a_hung_tool_is_killed_at_its_timeout(live: LoopbackApi, tmp_path: Path) -> None:
    mid, token = _commissioning_machine(live)
    with live.store.session() as s:  # the run's own copy of the profile: 1 s for nvidia-smi
        run = s.exec(CommissioningRun.__table__.select()).first()  # type: ignore[attr-defined]
        spec = json.loads(json.dumps(run.spec))
        spec["checks"][0]["timeout_s"] = 1
        s.exec(CommissioningRun.__table__.update().values(spec=spec))  # type: ignore[attr-defined,call-overload]
        s.commit()
    _run_agent(live, tmp_path, token, _tools(tmp_path, smi="", dmesg="", hang=True))
    state, run = _outcome(live, mid)
    assert state == "commission-failed"
    assert run.summary == "nvidia-smi: nvidia-smi did not finish within 1 s"
    assert os.path.exists(tmp_path / "state" / "commission-ran")


@pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed")
def test_long_output_keeps_its_head_and_its_tail(tmp_path: Path) -> None:
    # memtester prints megabytes of progress before "Done.": a cut that kept only the head
    # lost the verdict line (seen in the lab), so a passing memtester read as unfinished.
    (tmp_path / "c.full").write_text("got  16MB\n" + "\b" * 200_000 + "Done.\n")
    script = f'STATE={tmp_path}; . "{COMMISSION}"; RAW_LIMIT=1000; cut_output'
    subprocess.run([BUSYBOX, "sh", "-c", script], check=True, timeout=30)
    out = (tmp_path / "c.out").read_text()
    assert out.startswith("got  16MB") and out.endswith("Done.\n")
    assert "bytes cut here" in out and len(out) < 1100
