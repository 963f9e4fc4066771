"""Fault injection for the day-2 health proofs: a record in a machine's BMC event log (IPMI Add
SEL Entry), a stand-in ``nvidia-smi`` that can be switched to report a GPU fault, and a QEMU
machine paused and resumed through QMP (a node that stops answering).

``add_sel`` speaks IPMI over RMCP+ (cipher suite 3) with ipmitool, the same way a BMC's owner
would: any BMC with a System Event Log takes it (OpenIPMI's ``ipmi_sim``, a real BMC, the
lab's own virtual BMC with its ``vmlab.vsel``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .power import hung_marker
from .qmp import QmpClient

# ---- the BMC's System Event Log ------------------------------------------------------------

#: IPMI 2.0: NetFn Storage, Add SEL Entry.
NETFN_STORAGE, ADD_SEL_ENTRY = 0x0A, 0x44
#: Sensor types (IPMI 2.0 table 42-3) and their sensor-specific offsets.
SENSOR_MEMORY, MEMORY_UNCORRECTABLE_ECC = 0x0C, 0x01
SENSOR_POWER_SUPPLY, PSU_FAILURE_DETECTED = 0x08, 0x01
#: Event/reading type code "sensor-specific" (table 42-1).
SENSOR_SPECIFIC = 0x6F


@dataclass(frozen=True)
class SelRecord:
    """One system event record (IPMI 2.0 section 32.1, record type 0x02)."""

    sensor_type: int
    sensor_number: int
    offset: int
    #: Event data 1 bits 7:4 say what data 2 and 3 hold (0xF: unspecified, 0x2 in bits 5:4:
    #: data 3 is a sensor-specific extension, e.g. the memory module).
    data1_flags: int = 0x00
    data2: int = 0xFF
    data3: int = 0xFF
    assertion: bool = True
    generator_id: int = 0x0020  # the BMC (slave address 0x20), LUN 0
    event_type: int = SENSOR_SPECIFIC

    def raw(self, timestamp: int | None = None) -> bytes:
        """The 16 bytes of Add SEL Entry; the SEL device assigns the record ID."""
        ts = int(time.time()) if timestamp is None else timestamp
        direction = 0x00 if self.assertion else 0x80
        return bytes(
            [
                0x00,
                0x00,  # record ID (ignored)
                0x02,  # system event record
                *ts.to_bytes(4, "little"),
                *self.generator_id.to_bytes(2, "little"),
                0x04,  # event message format: IPMI 2.0
                self.sensor_type,
                self.sensor_number,
                direction | self.event_type,
                self.data1_flags | self.offset,
                self.data2,
                self.data3,
            ]
        )


def memory_uncorrectable_ecc(dimm: int = 0, sensor_number: int = 0x60) -> SelRecord:
    """Memory (0x0C) offset 0x01, uncorrectable ECC, on memory module ``dimm`` (event data 3)."""
    return SelRecord(SENSOR_MEMORY, sensor_number, MEMORY_UNCORRECTABLE_ECC, 0x20, 0xFF, dimm)


def psu_failure(sensor_number: int = 0x70) -> SelRecord:
    """Power Supply (0x08) offset 0x01, failure detected."""
    return SelRecord(SENSOR_POWER_SUPPLY, sensor_number, PSU_FAILURE_DETECTED)


@dataclass(frozen=True)
class BmcTarget:
    address: str
    port: int
    username: str
    password: str
    #: The network namespace the BMC address is reached from (the lab's), or None.
    netns: str | None = None


def bmc_target(machine: dict[str, Any] | BmcTarget, netns: str | None = None) -> BmcTarget:
    """A lab state machine entry (``state.json``'s ``machines[]``) or a target as it is."""
    if isinstance(machine, BmcTarget):
        return machine
    bmc = machine["bmc"]
    return BmcTarget(bmc["address"], int(bmc["ipmi_port"]), bmc["username"], bmc["password"], netns)


class FaultError(RuntimeError):
    pass


def add_sel(machine: dict[str, Any] | BmcTarget, record: SelRecord, *, timeout: float = 30) -> int:
    """Add ``record`` to the machine's BMC event log; returns the record ID the BMC gave it.
    The password goes to ipmitool through its environment (-E), never on a command line."""
    t = bmc_target(machine)
    ipmitool = shutil.which("ipmitool")
    if ipmitool is None:
        raise FaultError("ipmitool is not installed (Debian package ipmitool)")
    argv = [ipmitool, "-I", "lanplus", "-C", "3", "-H", t.address, "-p", str(t.port)]
    argv += ["-U", t.username, "-E", "raw", hex(NETFN_STORAGE), hex(ADD_SEL_ENTRY)]
    argv += [f"0x{b:02x}" for b in record.raw()]
    if t.netns:
        from netconfig.netns import exec_argv

        argv = exec_argv(t.netns, argv)
    env = dict(os.environ, IPMI_PASSWORD=t.password)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise FaultError(f"Add SEL Entry on {t.address}:{t.port} failed: {r.stderr.strip()[:300]}")
    got = [int(x, 16) for x in r.stdout.split()]
    if len(got) != 2:
        raise FaultError(f"Add SEL Entry answered {r.stdout.strip()!r}, not a record ID")
    return got[0] | got[1] << 8


# ---- a node that stops answering ---------------------------------------------------------------


async def vm_status(machine: dict[str, Any] | str | Path) -> str:
    """QEMU's run state (``running``, ``paused``, ``prelaunch`` ...) through the machine's
    QMP socket for tests (``qmp`` in the lab state, or a socket path)."""
    async with QmpClient(_qmp_path(machine)) as q:
        return str((await q.execute("query-status"))["status"])


async def pause(machine: dict[str, Any] | str | Path) -> None:
    """Freeze the machine's CPUs (QMP ``stop``): the node goes silent while its BMC still
    answers and still reports power on (the marker ``power.hung_marker``), as with a hung
    kernel. A power off, reset or cycle through the BMC ends the hang."""
    path = _qmp_path(machine)
    hung_marker(path).write_text("paused by vmlab.faults\n")
    async with QmpClient(path) as q:
        await q.execute("stop")


async def resume(machine: dict[str, Any] | str | Path) -> None:
    """Let a paused machine run on (QMP ``cont``)."""
    path = _qmp_path(machine)
    async with QmpClient(path) as q:
        await q.execute("cont")
    hung_marker(path).unlink(missing_ok=True)


def _qmp_path(machine: dict[str, Any] | str | Path) -> str:
    return str(machine["qmp"] if isinstance(machine, dict) else machine)


# ---- a stand-in nvidia-smi -------------------------------------------------------------------

#: The stand-in (a busybox sh script) and the real capture its outputs are derived from.
STANDIN = Path(__file__).resolve().parent.parent / "nvidia-smi-standin" / "nvidia-smi"
#: What the stand-in can be switched to (the file ``mode`` beside its outputs).
GPU_MODES = ("healthy", "xid79", "missing-gpu", "uncorrectable-ecc")
#: The XID 79 line the stand-in writes to the kernel log once, in mode xid79.
XID79 = "NVRM: Xid (PCI:{pci}): 79, pid=0, name=vmlab, GPU has fallen off the bus."


def gpu_outputs(capture: str) -> dict[str, str]:
    """The stand-in's ``nvidia-smi -q -x`` per mode, derived from a real capture: healthy (the
    capture), missing-gpu (its first ``<gpu>`` element removed: the GPU fell off the bus, the
    driver no longer describes it), uncorrectable-ecc (the first GPU's volatile and aggregate
    DRAM uncorrectable counters at 2 and the row-remap failure flag set)."""
    first = re.search(r"\n?[ \t]*<gpu id=.*?</gpu>", capture, re.S)
    if first is None:
        raise ValueError("the capture describes no <gpu>")
    gpu = first.group(0)
    ecc = re.sub(r"<dram_uncorrectable>\d+</dram_uncorrectable>",
                 "<dram_uncorrectable>2</dram_uncorrectable>", gpu)  # fmt: skip
    if ecc == gpu:
        raise ValueError("the capture's first GPU has no dram_uncorrectable counters")
    missing = capture.replace(gpu, "", 1)
    return {
        "healthy": capture,
        "xid79": missing,
        "missing-gpu": missing,
        "uncorrectable-ecc": capture.replace(gpu, ecc, 1),
    }


def install_gpu_standin(folder: Path, capture: str, mode: str = "healthy") -> Path:
    """The stand-in in ``folder/bin/nvidia-smi`` (put ``folder/bin`` first on the node
    agent's PATH) with its outputs beside it; returns the bin folder."""
    bin_ = folder / "bin"
    bin_.mkdir(parents=True, exist_ok=True)
    for name, text in gpu_outputs(capture).items():
        (folder / f"{name}.xml").write_text(text)
    # the kernel names the GPU by its 4-digit domain: <gpu id="00000000:01:00.0"> -> 0000:01:00
    pci = re.search(
        r'<gpu id="[0-9A-Fa-f]{4}([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})\.', capture
    )
    (folder / "xid79.line").write_text(
        XID79.format(pci=pci.group(1) if pci else "0000:00:00") + "\n"
    )
    shutil.copyfile(STANDIN, bin_ / "nvidia-smi")
    (bin_ / "nvidia-smi").chmod(0o755)
    set_gpu_mode(folder, mode)
    return bin_


def set_gpu_mode(folder: Path, mode: str) -> None:
    """Switch the stand-in (it reads the mode on every call)."""
    if mode not in GPU_MODES:
        raise ValueError(f"unknown GPU fault {mode!r}; one of {', '.join(GPU_MODES)}")
    tmp = folder / "mode.new"
    tmp.write_text(mode + "\n")
    tmp.replace(folder / "mode")
