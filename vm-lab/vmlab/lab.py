"""A lab: build it, describe it in a state file, and tear it down from that file alone.

Layout under the lab home (default ``<repo>/.cache/vm-lab``, or ``$VMLAB_HOME``)::

    <home>/accel.json            which accelerator works here (probed once)
    <home>/<name>/state.json     everything the lab owns (0600: holds BMC credentials)
    <home>/<name>/m0.qcow2, m0.serial.log, m0.qmp, m0.qmp-bmc, m0.bmc.log, ...

Every resource is written to the state file before it is made, so ``down`` works after the
process that ran ``up`` was killed at any point. ``down`` also kills any other process still
living in the lab's namespace (metald, for instance) before deleting the namespace.
Slots (which give each lab its subnet and interface names) are claimed host-wide as files in
/run/vm-lab/slots, so labs with different homes never pick the same one.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import netns, plan, procs, qemu

REPO_ROOT = Path(__file__).resolve().parents[2]  # the lab is installed editable from vm-lab/
SLOTS_DIR = Path("/run/vm-lab/slots")
STATE_VERSION = 1
BMC_USER = "admin"
BMC_READY_TIMEOUT = 30.0


class LabError(RuntimeError):
    """The lab could not be built, found or removed."""


def default_home() -> Path:
    return Path(os.environ.get("VMLAB_HOME") or REPO_ROOT / ".cache" / "vm-lab")


# ---- state file --------------------------------------------------------------------------------


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Atomically replace the state file, readable by root only (it holds BMC passwords)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_state(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


# ---- slots -------------------------------------------------------------------------------------


def _slot_is_stale(slot_file: Path) -> bool:
    try:
        claim = json.loads(slot_file.read_text())
    except (OSError, ValueError):
        return True
    ns = plan.netns_name(claim["name"])
    return not netns.exists(ns) and not Path(claim.get("state", "/nonexistent")).exists()


def claim_slot(name: str, state_path: Path) -> int:
    """Claim the lowest free slot for ``name``; refuse a name another live lab holds."""
    SLOTS_DIR.mkdir(parents=True, exist_ok=True)
    with open(SLOTS_DIR.parent / "slots.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two `up`s at once must not pick one slot or name
        free = None
        for slot in range(1, plan.MAX_SLOT + 1):
            slot_file = SLOTS_DIR / str(slot)
            if slot_file.exists() and _slot_is_stale(slot_file):
                with contextlib.suppress(FileNotFoundError):
                    slot_file.unlink()
            if not slot_file.exists():
                free = slot if free is None else free
                continue
            with contextlib.suppress(OSError, ValueError):
                if json.loads(slot_file.read_text()).get("name") == name:
                    raise LabError(f"lab name {name} is in use (slot {slot})")
        if free is None:
            raise LabError(f"all {plan.MAX_SLOT} lab slots are taken")
        (SLOTS_DIR / str(free)).write_text(json.dumps({"name": name, "state": str(state_path)}))
        return free


def release_slots(name: str) -> None:
    if not SLOTS_DIR.is_dir():
        return
    for slot_file in SLOTS_DIR.iterdir():
        try:
            claim = json.loads(slot_file.read_text())
        except (OSError, ValueError):
            continue
        if claim.get("name") == name:
            with contextlib.suppress(FileNotFoundError):
                slot_file.unlink()


# ---- the lab -----------------------------------------------------------------------------------


class Lab:
    """A virtual rack: ``Lab("demo", machines=4, uefi=2).up()``, later ``.down()``."""

    def __init__(
        self,
        name: str,
        machines: int = 2,
        uefi: int | None = None,
        workdir: Path | None = None,
        memory_mb: int = 1024,
        cpus: int = 2,
        disk_size: str = "2G",
        nic_rom: bool = True,
        rng: bool = False,
        arm64: int = 0,
        tpm: bool = False,
        secure_boot: bool = False,
        nics: int = 1,
        disks: int = 1,
    ) -> None:
        """``nics``: NICs per machine: the first on the boot network, the others on the lab's
        data network (a second bridge, ``plan.data_bridge_name``), without option ROMs and
        outside the boot order. ``disks``: disks per machine (each ``disk_size``; with more
        than one, each has a serial number, ``vmlab.qemu.disk_serial``). ``nic_rom=False``: the NIC has no option ROM (no iPXE), so the firmware network-boots
        with its own PXE (OVMF: DHCP, TFTP of ipxe.efi, then iPXE). ``rng``: each machine gets
        a virtio RNG (``vmlab.qemu.MachineSpec.rng``). ``arm64``: the last this many of the
        UEFI machines are arm64 (QEMU's virt board, AAVMF, TCG; ``vmlab.qemu``). ``tpm``: each
        amd64 UEFI machine gets a TPM 2.0 (swtpm, with an EK certificate) and OVMF's measured
        boot (``vmlab.qemu.create_tpm``). ``secure_boot``: each amd64 UEFI machine boots OVMF's
        Secure Boot build, and its BMC's Secure Boot state is written into its variables at
        each power-on through the BMC (``vmlab.secureboot_fw``)."""
        self.name = plan.check_name(name)
        self.machines = machines
        self.uefi = machines // 2 if uefi is None else uefi
        self.home = Path(workdir) if workdir else default_home()
        self.dir = self.home / name
        self.state_path = self.dir / "state.json"
        self.netns = plan.netns_name(name)
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.disk_size = disk_size
        self.nic_rom = nic_rom
        self.rng = rng
        if not 0 <= arm64 <= self.uefi:
            raise LabError(f"arm64 machines boot UEFI: arm64 must be 0..{self.uefi}, not {arm64}")
        self.arm64 = arm64
        self.tpm = tpm
        self.secure_boot = secure_boot
        if not 1 <= nics <= plan.MAX_EXTRA_NICS + 1:
            raise LabError(f"nics must be 1..{plan.MAX_EXTRA_NICS + 1}, not {nics}")
        if not 1 <= disks <= 8:
            raise LabError(f"disks must be 1..8, not {disks}")
        if (nics > 1 or disks > 1) and arm64:
            raise LabError("further NICs and disks are for amd64 machines only")
        self.nics = nics
        self.disks = disks
        self.state: dict[str, Any] = {}

    @classmethod
    def load(cls, name: str, workdir: Path | None = None) -> Lab:
        lab = cls(name, workdir=workdir)
        if not lab.state_path.exists():
            raise LabError(f"no lab {name} under {lab.home}")
        lab.state = read_state(lab.state_path)
        lab.machines = len(lab.state["machines"])
        lab.uefi = sum(m["firmware"] == "uefi" for m in lab.state["machines"])
        return lab

    # ---- up ------------------------------------------------------------------------------------

    def up(self) -> dict[str, Any]:
        if self.state_path.exists():
            raise LabError(f"lab {self.name} exists ({self.state_path}); run down first")
        if netns.exists(self.netns):
            raise LabError(f"namespace {self.netns} exists; run 'vm-lab down --name {self.name}'")
        plan.plan_machines(1, self.machines, self.uefi)  # reject bad sizes before touching anything
        # One probe per host, whatever the lab's home (tests use throwaway homes).
        accel = qemu.choose_accelerator(default_home())
        # Claimed outside the clean-up below: failing here must not tear down a lab that
        # another process is building under the same name.
        slot = claim_slot(self.name, self.state_path)
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.state = self._planned_state(slot, accel)
            self._save()
            self._build()
        except BaseException:
            self.down()
            raise
        return self.state

    def _planned_state(self, slot: int, accel: str) -> dict[str, Any]:
        machines = []
        for m in plan.plan_machines(slot, self.machines, self.uefi):
            base = self.dir / m.name
            arch = "arm64" if m.index >= self.machines - self.arm64 else "amd64"
            uefi_amd64 = m.firmware == "uefi" and arch == "amd64"
            has_tpm = self.tpm and uefi_amd64
            machines.append(
                {
                    "name": m.name,
                    "index": m.index,
                    "firmware": m.firmware,
                    "uuid": str(uuid.uuid4()),
                    "serial_number": f"VMLAB-{self.name}-{m.name}".upper(),
                    "mac": m.mac,
                    "tap": m.tap,
                    "memory_mb": self.memory_mb,
                    "cpus": self.cpus,
                    "nic_rom": self.nic_rom,
                    "rng": self.rng,
                    "arch": arch,
                    "tpm": {"state": f"{base}.tpm", "socket": f"{base}.tpm.sock"}
                    if has_tpm
                    else None,
                    "secure_boot": self.secure_boot and uefi_amd64,
                    "disk": f"{base}.qcow2",
                    "extra_nics": [
                        {
                            "mac": plan.nic_mac(slot, m.index, j),
                            "tap": plan.nic_tap_name(slot, m.index, j),
                        }
                        for j in range(1, self.nics)
                    ],
                    "extra_disks": [f"{base}.d{j}.qcow2" for j in range(1, self.disks)],
                    "uefi_vars": f"{base}.vars.fd" if m.firmware == "uefi" else None,
                    "serial_log": f"{base}.serial.log",
                    "qemu_log": f"{base}.qemu.log",
                    "qmp": f"{base}.qmp",
                    "qmp_bmc": f"{base}.qmp-bmc",
                    "bmc_log": f"{base}.bmc.log",
                    "bmc_ready": f"{base}.bmc.ready",
                    "bmc_commands": f"{base}.bmc-commands.log",
                    "bmc_hold_off": f"{base}.bmc.hold-off",
                    "bmc": {
                        "address": m.bmc_address,
                        "ipmi_port": plan.IPMI_PORT,
                        "redfish_port": plan.REDFISH_PORT,
                        "redfish_url": f"http://{m.bmc_address}:{plan.REDFISH_PORT}",
                        "username": BMC_USER,
                        # IPMI 2.0 passwords are at most 20 bytes: 16 characters fit.
                        "password": secrets.token_urlsafe(12),
                    },
                }
            )
        low, high = plan.dhcp_range(slot)
        return {
            "version": STATE_VERSION,
            "name": self.name,
            "status": "building",
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "driver_pid": os.getpid(),
            "slot": slot,
            "netns": self.netns,
            "bridge": plan.bridge_name(slot),
            "data_bridge": plan.data_bridge_name(slot) if self.nics > 1 else None,
            "subnet": str(plan.subnet(slot)),
            "lab_supernet": str(plan.lab_supernet(slot)),
            "boot_address": str(plan.boot_address(slot)),
            "dhcp_range": [str(low), str(high)],
            "accel": accel,
            "dir": str(self.dir),
            "processes": [],
            "machines": machines,
        }

    def _build(self) -> None:
        s = self.state
        prefix = plan.subnet(s["slot"]).prefixlen
        netns.create(self.netns)
        addresses = [s["boot_address"]] + [m["bmc"]["address"] for m in s["machines"]]
        netns.add_bridge(self.netns, s["bridge"], addresses, prefix)
        netns.add_taps(self.netns, s["bridge"], [m["tap"] for m in s["machines"]])
        if s.get("data_bridge"):
            netns.add_bridge(self.netns, s["data_bridge"], [], prefix)
            taps = [n["tap"] for m in s["machines"] for n in m["extra_nics"]]
            netns.add_taps(self.netns, s["data_bridge"], taps)

        started = []
        for m in s["machines"]:
            for disk in [m["disk"], *m.get("extra_disks", [])]:
                qemu.create_disk(Path(disk), self.disk_size)
            if m["uefi_vars"]:
                big = bool(m.get("tpm") or m.get("secure_boot"))
                qemu.create_uefi_vars(Path(m["uefi_vars"]), m.get("arch", "amd64"), tpm=big)
            if m.get("tpm"):
                self._start_tpm(m)
            spec = self._spec(m)
            log = Path(m["qemu_log"])
            argv = qemu.command_line(spec, s["accel"])
            if m.get("secure_boot"):
                m["qemu_argv"] = argv  # its BMC restarts it on new variables (secureboot_fw)
            proc = self.spawn(argv, role="qemu", log=log, machine=m)
            started.append((m, proc))
        for m, proc in started:
            qemu.wait_for_socket(Path(m["qmp_bmc"]), proc, Path(m["qemu_log"]))
            qemu.wait_for_socket(Path(m["qmp"]), proc, Path(m["qemu_log"]))

        bmcs = []
        for m in s["machines"]:
            argv = [sys.executable, "-m", "vmlab.vbmc", "--state", str(self.state_path)]
            argv += ["--machine", m["name"]]
            bmcs.append((m, self.spawn(argv, role="bmc", log=Path(m["bmc_log"]), machine=m)))
        for m, proc in bmcs:
            _wait_ready(Path(m["bmc_ready"]), proc, Path(m["bmc_log"]))
        s["status"] = "up"
        self._save()

    def _start_tpm(self, m: dict[str, Any]) -> None:
        tpm = m["tpm"]
        state, sock = Path(tpm["state"]), Path(tpm["socket"])
        qemu.create_tpm(state)
        log = Path(tpm["state"] + ".log")
        proc = self.spawn(qemu.tpm_command_line(state, sock), role="swtpm", log=log, machine=m)
        deadline = time.monotonic() + BMC_READY_TIMEOUT
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise LabError(f"swtpm for {m['name']} did not start: {_tail(log)}")
            time.sleep(0.05)

    def _spec(self, m: dict[str, Any]) -> qemu.MachineSpec:
        return qemu.MachineSpec(
            name=f"{self.name}-{m['name']}",
            firmware=m["firmware"],
            uuid=m["uuid"],
            mac=m["mac"],
            tap=m["tap"],
            disk=Path(m["disk"]),
            serial_log=Path(m["serial_log"]),
            qmp_bmc=Path(m["qmp_bmc"]),
            qmp=Path(m["qmp"]),
            uefi_vars=Path(m["uefi_vars"]) if m["uefi_vars"] else None,
            memory_mb=m["memory_mb"],
            cpus=m["cpus"],
            serial_number=m["serial_number"],
            nic_rom=m.get("nic_rom", True),
            rng=m.get("rng", False),
            arch=m.get("arch", "amd64"),
            tpm_socket=Path(m["tpm"]["socket"]) if m.get("tpm") else None,
            secure_boot=bool(m.get("secure_boot")),
            extra_nics=tuple((n["mac"], n["tap"]) for n in m.get("extra_nics", [])),
            extra_disks=tuple(Path(d) for d in m.get("extra_disks", [])),
        )

    # ---- processes in the namespace ------------------------------------------------------------

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """argv that runs ``argv`` inside the lab's namespace (for metald and tests)."""
        return netns.exec_argv(self.netns, argv)

    def spawn(
        self,
        argv: Sequence[str],
        role: str,
        log: Path | None = None,
        machine: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen:
        """Start a process inside the namespace, in its own session, recorded in the state file.

        ``down`` stops it (SIGTERM to its process group, then SIGKILL).
        """
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
        full_env = dict(os.environ if env is None else env)
        try:
            proc = subprocess.Popen(
                self.exec_argv(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=full_env,
            )
        finally:
            if log:
                out.close()
        entry = {"role": role, "pid": proc.pid, "start_time": procs.start_time(proc.pid)}
        if machine is not None:
            entry["machine"] = machine["name"]
        self.state.setdefault("processes", []).append(entry)
        self._save()
        return proc

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run a command inside the namespace and wait for it (``subprocess.run`` arguments)."""
        return subprocess.run(self.exec_argv(argv), **kwargs)

    def add_namespace(self, suffix: str) -> dict[str, Any]:
        """A namespace joined to the lab bridge by a veth pair, with an address in the boot
        network (10.k.0.240 and up): room for a tenant control plane or a WireGuard hub.
        Start processes in it with ``netns.exec_argv(entry["netns"], argv)``; ``down`` stops
        them and deletes it.
        """
        s = self.state
        attached = s.setdefault("namespaces", [])
        index = len(attached)
        outer, inner = plan.attached_veth_names(s["slot"], index)
        entry = {
            "suffix": suffix,
            "netns": plan.attached_netns_name(self.name, suffix),
            "veth": outer,
            "peer": inner,
            "address": str(plan.attached_address(s["slot"], index)),
        }
        if any(a["suffix"] == suffix for a in attached):
            raise LabError(f"lab {self.name} already has a namespace {suffix}")
        attached.append(entry)
        self._save()  # recorded before it exists, like everything else
        netns.create(entry["netns"])
        prefix = plan.subnet(s["slot"]).prefixlen
        netns.add_veth_to_bridge(
            self.netns, s["bridge"], outer, inner, entry["netns"], entry["address"], prefix
        )
        return entry

    # ---- down ----------------------------------------------------------------------------------

    def down(self, keep_logs: bool = False) -> None:
        """Remove everything the lab owns; safe to call on a half-built or already-removed lab."""
        state = self.state
        if not state and self.state_path.exists():
            with contextlib.suppress(OSError, ValueError):
                state = read_state(self.state_path)
        teardown(self.name, state, self.dir, keep_logs=keep_logs)
        self.state = {}

    def _save(self) -> None:
        write_state(self.state_path, self.state)

    # ---- views ---------------------------------------------------------------------------------

    def machine(self, name: str) -> dict[str, Any]:
        for m in self.state["machines"]:
            if m["name"] == name:
                return m
        raise LabError(f"lab {self.name} has no machine {name}")


def _wait_ready(ready: Path, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + BMC_READY_TIMEOUT
    while time.monotonic() < deadline:
        if ready.exists():
            return
        if proc.poll() is not None:
            raise LabError(f"virtual BMC exited with {proc.returncode}: {_tail(log)}")
        time.sleep(0.05)
    raise LabError(f"virtual BMC not ready in {BMC_READY_TIMEOUT:.0f} s: {_tail(log)}")


def _tail(log: Path, size: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-size:]
    except OSError:
        return "(no log)"


def teardown(name: str, state: dict[str, Any], lab_dir: Path, keep_logs: bool = False) -> None:
    """Stop the lab's processes, delete its namespace (and so its bridge and taps), its files
    and its slot. Needs nothing but the lab's name; the state file adds the recorded pids."""
    ns = plan.netns_name(name)
    # The lab's own namespace and those attached to it, found by name as well as in the state.
    namespaces = [ns] + sorted(
        {a["netns"] for a in state.get("namespaces", [])}
        | {n for n in netns.list_namespaces(ns + "+")}
    )
    recorded = [
        p["pid"]
        for p in state.get("processes", [])
        if procs.same_process(p["pid"], p.get("start_time"))
    ]
    left = procs.terminate(recorded, groups=True)
    # Anything else still in these namespaces (metald, a test's helper) goes too, but only
    # itself: its process group may hold processes outside the lab.
    for name_ns in namespaces:
        left += procs.terminate(netns.pids(name_ns), groups=False)
    if left:
        raise LabError(f"lab {name}: processes {left} did not stop")
    for name_ns in reversed(namespaces):
        netns.delete(name_ns)  # an attached namespace's veth pair goes with it
    release_slots(name)
    if lab_dir.exists():
        if keep_logs:
            for path in lab_dir.iterdir():
                if not path.name.endswith(".log"):
                    _remove(path)
        else:
            shutil.rmtree(lab_dir, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def list_labs(home: Path | None = None) -> list[str]:
    """Labs with a state directory under ``home``, plus any lab namespace left on the host."""
    home = home or default_home()
    names = set()
    if home.is_dir():
        names |= {p.name for p in home.iterdir() if (p / "state.json").exists()}
    names |= {plan.lab_of_netns(ns) for ns in netns.list_namespaces(plan.NETNS_PREFIX)}
    return sorted(n for n in names if n and plan.NAME_RE.match(n))


def down_all(home: Path | None = None) -> list[str]:
    names = list_labs(home)
    for name in names:
        Lab(name, workdir=home).down()
    return names
