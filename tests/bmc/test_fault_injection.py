"""The lab's fault injection (vmlab.faults) on the real parts: records added to OpenIPMI's
ipmi_sim through Add SEL Entry and read back through metald's own IPMI event-log path and
ipmitool; QMP stop/cont on a QEMU process; the stand-in nvidia-smi's faults read by metald's
node-report parser."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from metald.bmc.base import BmcEndpoint
from metald.bmc.ipmi import IpmiDriver
from metald.health.node import NodeReport, report_signals
from metald.health.signals import Kind
from tests.bmc.peers import IpmiSim
from vmlab import cli as vmlab_cli
from vmlab import faults, procs
from vmlab.power import MachineControl, hung_marker

A100_XML = (
    Path(__file__).resolve().parents[2]
    / "tests/fixtures/gpu/nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml"
)


def _target(sim: IpmiSim) -> faults.BmcTarget:
    return faults.BmcTarget("127.0.0.1", sim.port, sim.username, sim.password)


def test_records_are_the_ipmi_layout() -> None:
    raw = faults.memory_uncorrectable_ecc(dimm=3).raw(timestamp=0x01020304)
    assert len(raw) == 16
    assert raw[2] == 0x02 and raw[3:7] == bytes([4, 3, 2, 1])  # system event, LE timestamp
    assert raw[10] == 0x0C and raw[12] == 0x6F  # memory, sensor-specific, assertion
    assert raw[13] == 0x21 and raw[15] == 3  # uncorrectable ECC; data 3 = the module
    psu = faults.psu_failure().raw(timestamp=0)
    assert (psu[10], psu[13]) == (0x08, 0x01)
    assert faults.SelRecord(0x0C, 1, 1, assertion=False).raw(timestamp=0)[12] == 0xEF


@pytest.mark.skipif(shutil.which("ipmitool") is None, reason="needs ipmitool")
async def test_add_sel_reaches_metalds_event_log_read(ipmi_sim: IpmiSim) -> None:
    ids = [
        await asyncio.to_thread(faults.add_sel, _target(ipmi_sim), rec)
        for rec in (faults.memory_uncorrectable_ecc(dimm=2), faults.psu_failure())
    ]
    assert len(set(ids)) == 2
    ep = BmcEndpoint("127.0.0.1", ipmi_sim.port, ipmi_sim.username, ipmi_sim.password)
    d = IpmiDriver(ep, request_timeout_s=5.0, resend_s=0.3)
    try:
        log = await d.event_log()
    finally:
        await d.close()
    by_id = {e.id: e for e in log}
    assert {str(i) for i in ids} <= set(by_id)  # the emulation's own record stays too
    mem, psu = by_id[str(ids[0])], by_id[str(ids[1])]
    print(mem, psu, sep="\n")
    assert "Memory" in mem.message and "ncorrectable" in mem.message
    assert mem.severity == "critical"
    assert "Power Supply" in psu.message and "ailure" in psu.message
    # ipmitool reads the same records
    out = subprocess.run(
        ["ipmitool", "-I", "lanplus", "-C", "3", "-H", "127.0.0.1", "-p", str(ipmi_sim.port),
         "-U", ipmi_sim.username, "-P", ipmi_sim.password, "sel", "list"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert "Uncorrectable ECC" in out and "Failure detected" in out


@pytest.mark.skipif(shutil.which("ipmitool") is None, reason="needs ipmitool")
def test_add_sel_says_why_a_bmc_refused(ipmi_sim: IpmiSim) -> None:
    bad = faults.BmcTarget("127.0.0.1", ipmi_sim.port, ipmi_sim.username, "wrong-password")
    with pytest.raises(faults.FaultError, match="Add SEL Entry on 127.0.0.1"):
        faults.add_sel(bad, faults.psu_failure(), timeout=60)


def test_a_lab_state_entry_is_a_target() -> None:
    m = {"bmc": {"address": "10.1.0.5", "ipmi_port": 623, "username": "u", "password": "p"}}
    assert faults.bmc_target(m, "lab0") == faults.BmcTarget("10.1.0.5", 623, "u", "p", "lab0")


@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs QEMU")
async def test_pause_and_resume_through_qmp(tmp_path: Path) -> None:
    sock, bmc_sock = tmp_path / "m.qmp", tmp_path / "m.qmp-bmc"
    proc = subprocess.Popen(
        ["qemu-system-x86_64", "-accel", "tcg", "-machine", "none", "-nodefaults",
         "-display", "none", "-qmp", f"unix:{sock},server=on,wait=off",
         "-qmp", f"unix:{bmc_sock},server=on,wait=off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (sock.exists() and bmc_sock.exists()):
            assert proc.poll() is None and time.monotonic() < deadline, "QEMU did not start"
            await asyncio.sleep(0.05)
        machine = {"qmp": str(sock)}
        # the lab BMC's view of the same machine, as vmlab.vbmc builds it
        bmc = MachineControl(str(bmc_sock), hung=hung_marker(bmc_sock))
        await bmc.connect()
        try:
            assert await faults.vm_status(machine) == "running"
            await faults.pause(machine)
            assert await faults.vm_status(machine) == "paused"
            assert await bmc.is_on()  # hung, not off: the BMC still sees power
            assert await asyncio.to_thread(vmlab_cli._power, str(sock)) == "hung"
            await faults.resume(machine)
            assert await faults.vm_status(machine) == "running"
            await faults.pause(machine)
            await bmc.power_off()  # the BMC's owner pulls the power: the hang is over
            assert not await bmc.is_on() and not hung_marker(sock).exists()
        finally:
            await bmc.close()
    finally:
        procs.stop_group(proc)


def _signals(kernel_log: str, xml: str, gpu_count: int) -> set[tuple[Kind, str]]:
    r = NodeReport(at=datetime.now(UTC), kernel_log=kernel_log, nvidia_smi_xml=xml)
    out = report_signals(r, gpu_count=gpu_count)
    assert out.unreadable == []
    return {(s.kind, s.code) for s in out.signals}


@pytest.mark.skipif(shutil.which("busybox") is None, reason="needs busybox")
def test_the_gpu_standin_switches_faults(tmp_path: Path) -> None:
    bin_ = faults.install_gpu_standin(tmp_path / "gpu", A100_XML.read_text())
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")

    def smi(*args: str) -> str:
        r = subprocess.run(
            ["busybox", "sh", str(bin_ / "nvidia-smi"), *args],
            capture_output=True, text=True, check=True,
            env={"PATH": "/usr/bin:/bin", "NVIDIA_SMI_STANDIN_KMSG": str(kmsg)},
        )  # fmt: skip
        return r.stdout

    healthy = smi("-q", "-x", "-d", "ECC,PAGE_RETIREMENT,ROW_REMAPPER,PERFORMANCE")
    assert healthy == A100_XML.read_text()
    assert (Kind.GPU_COUNT, "missing") not in _signals(kmsg.read_text(), healthy, 1)

    faults.set_gpu_mode(tmp_path / "gpu", "uncorrectable-ecc")
    found = _signals("", smi("-q", "-x"), 1)
    assert {
        (Kind.GPU_ECC, "uncorrectable-volatile"),
        (Kind.GPU_ECC, "uncorrectable-aggregate"),
    } <= found

    faults.set_gpu_mode(tmp_path / "gpu", "missing-gpu")
    assert (Kind.GPU_COUNT, "missing") in _signals("", smi("-q", "-x"), 1)

    faults.set_gpu_mode(tmp_path / "gpu", "xid79")
    xml = smi("-q", "-x")
    smi("-q", "-x")  # the XID line is written once
    assert kmsg.read_text().count("Xid") == 1
    found = _signals(kmsg.read_text(), xml, 1)
    assert {(Kind.XID, "79"), (Kind.GPU_COUNT, "missing")} <= found
    assert "NVRM: Xid (PCI:0000:01:00): 79," in kmsg.read_text()
    with pytest.raises(ValueError, match="unknown GPU fault"):
        faults.set_gpu_mode(tmp_path / "gpu", "on-fire")


_LAB_BMC = """
import sys
from vmlab.vbmc import LabIpmiBmc
bmc = LabIpmiBmc({"admin": sys.argv[2]}, "127.0.0.1", int(sys.argv[1]),
                 "6f0b8a52-3c1d-4e8e-9d1a-2b7c5e4f0a11", None, None)
bmc.listen()
"""


@pytest.fixture
def lab_bmc(tmp_path: Path):  # type: ignore[no-untyped-def]
    """The lab's own virtual BMC (vmlab.vbmc's IPMI server) without a machine behind it: the
    SEL commands need none."""
    from tests.bmc.peers import _stop, _wait_udp_bound, free_port

    port, password = free_port(), "lab-bmc-pw-1234"
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAB_BMC, str(port), password],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "vbmc.log").open("wb"),
    )
    try:
        _wait_udp_bound(port, proc)
        yield faults.BmcTarget("127.0.0.1", port, "admin", password)
    finally:
        _stop(proc)


@pytest.mark.skipif(shutil.which("ipmitool") is None, reason="needs ipmitool")
async def test_the_lab_bmc_keeps_a_sel_metald_reads(lab_bmc: faults.BmcTarget) -> None:
    ep = BmcEndpoint(lab_bmc.address, lab_bmc.port, lab_bmc.username, lab_bmc.password)
    d = IpmiDriver(ep, request_timeout_s=5.0, resend_s=0.3)
    try:
        assert await d.event_log() == []  # an empty SEL reads as empty, not as an error
        first = await asyncio.to_thread(faults.add_sel, lab_bmc, faults.psu_failure())
        second = await asyncio.to_thread(
            faults.add_sel, lab_bmc, faults.memory_uncorrectable_ecc(dimm=1)
        )
        assert (first, second) == (1, 2)
        log = await d.event_log()
    finally:
        await d.close()
    assert [e.id for e in log] == ["1", "2"]
    assert "Power Supply" in log[0].message and "ailure" in log[0].message
    assert "Memory" in log[1].message and "ncorrectable" in log[1].message
    assert all(e.severity == "critical" and e.at is not None for e in log)
    out = subprocess.run(
        ["ipmitool", "-I", "lanplus", "-C", "3", "-H", lab_bmc.address, "-p", str(lab_bmc.port),
         "-U", lab_bmc.username, "-P", lab_bmc.password, "sel", "list"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert "Failure detected" in out and "Uncorrectable ECC" in out
