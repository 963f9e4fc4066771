"""QEMU machines of the lab: accelerator choice, command line, start.

Power model: each machine's QEMU process runs for the whole life of the lab and starts paused
(``-S``). "Off" is a paused VM, "on" is a running one, and power-on is always reset-then-run,
so a machine powers on from its reset vector exactly like a real one. Keeping the process means
the tap, the QMP sockets, the serial log and the pid stay the same for the lab's life, which makes
teardown after a crash simple (the pids in the state file are the only processes), and lets the
boot order be changed at run time: QEMU rebuilds the firmware's ``bootorder`` file from the
devices' ``bootindex`` at every reset, so the BMC sets ``bootindex`` over QMP and resets.
``-no-shutdown`` turns a guest's own poweroff into a stopped (off) VM instead of an exit.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

QEMU = "qemu-system-x86_64"
OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS.fd")
#: arm64 machines (a Grace tray's stand-in): QEMU's "virt" board with AAVMF, the arm64 build
#: of the same UEFI firmware (Debian: qemu-system-arm, qemu-efi-aarch64). Always TCG here.
QEMU_ARM64 = "qemu-system-aarch64"
AAVMF_CODE = Path("/usr/share/AAVMF/AAVMF_CODE.fd")
AAVMF_VARS = Path("/usr/share/AAVMF/AAVMF_VARS.fd")
#: A machine with a TPM boots the 4 MB build of OVMF: the one with measured boot (TPM 2.0
#: measurements and the TCG2 event log) that the attestation proofs use.
OVMF_CODE_4M = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS_4M = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
#: A Secure Boot machine boots OVMF's Secure Boot build (which needs SMM); its variables
#: start without keys (setup mode) until its BMC enrolls some (vmlab.secureboot_fw).
OVMF_CODE_SECBOOT = Path("/usr/share/OVMF/OVMF_CODE_4M.secboot.fd")
SWTPM = "swtpm"
ARM64_CPU = "cortex-a72"
PROBE_KERNEL = Path("/usr/lib/ipxe/ipxe.lkrn")
NIC_ID = "nic0"
DISK_ID = "disk0"
#: The virtual BMC's CD drive (VirtualMedia): empty at start, out of the boot order until the
#: BMC sets a CD boot; its medium is changed over QMP (``blockdev-change-medium``).
CD_ID = "cd0"


class QemuError(RuntimeError):
    """A machine could not be created or started."""


@dataclass(frozen=True)
class MachineSpec:
    """What one QEMU machine is made of; paths are absolute."""

    name: str
    firmware: str  # "bios" or "uefi"
    uuid: str
    mac: str
    tap: str
    disk: Path
    serial_log: Path
    qmp_bmc: Path  # the virtual BMC's own QMP connection
    qmp: Path  # a second QMP socket for tests, people and tools
    uefi_vars: Path | None = None
    memory_mb: int = 1024
    cpus: int = 2
    serial_number: str = ""
    nic_rom: bool = True  # False: no option ROM on the NIC (the firmware's own PXE boots)
    #: A hardware RNG (virtio-rng): metald's own iPXE seeds TLS from the firmware's RNG protocol
    #: and without one spends seconds gathering entropy. Off by default: with it, the multi-
    #: instance failover lab's warm machines (NIC out of the boot order) network-booted on
    #: their own (tests/e2e/test_fleet_failover.py), so only the built-iPXE runs ask for it.
    rng: bool = False
    #: "amd64" (q35/pc with OVMF/SeaBIOS) or "arm64" (virt with AAVMF, UEFI only, TCG).
    arch: str = "amd64"
    #: swtpm's control socket: the machine has a TPM 2.0 (``tpm-tis``) and boots OVMF's 4 MB
    #: build, which measures the boot into it (UEFI amd64 machines only).
    tpm_socket: Path | None = None
    #: OVMF's Secure Boot build (SMM, the variable store on a secure pflash; UEFI amd64).
    secure_boot: bool = False
    #: Further NICs, (MAC, tap) each: virtio-net without an option ROM and outside the boot
    #: order (the machine network-boots from its first NIC only), as a server's data ports.
    extra_nics: tuple[tuple[str, str], ...] = ()
    #: Further disks (qcow2), outside the boot order. With any, every disk has a serial
    #: number (``disk_serial``), which root device hints can name.
    extra_disks: tuple[Path, ...] = ()


def disk_serial(spec: MachineSpec, index: int) -> str:
    """The serial number of a machine's disk ``index`` (0: the boot disk): ``<machine
    serial>-D<index>``, cut to virtio-blk's 20 bytes from the left (the end tells disks apart)."""
    return f"{spec.serial_number or spec.name}-D{index}"[-20:].lstrip("-")


def extra_device_args(spec: MachineSpec) -> list[str]:
    """The command line of ``spec``'s further NICs and disks."""
    argv: list[str] = []
    for j, (mac, tap) in enumerate(spec.extra_nics, start=1):
        argv += [
            "-netdev", f"tap,id=net{j},ifname={tap},script=no,downscript=no",
            "-device", f"virtio-net-pci,id=nic{j},netdev=net{j},mac={mac},romfile=",
        ]  # fmt: skip
    for j, disk in enumerate(spec.extra_disks, start=1):
        argv += [
            "-drive", f"file={disk},if=none,id=drive{j},format=qcow2,cache=unsafe",
            "-device", f"virtio-blk-pci,id=disk{j},drive=drive{j},serial={disk_serial(spec, j)}",
        ]  # fmt: skip
    return argv


# ---- accelerator -------------------------------------------------------------------------------


def _qemu_version() -> str:
    out = subprocess.run([QEMU, "--version"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()[0].strip()


def _kvm_boots_probe(timeout: float) -> bool:
    """Whether a KVM guest gets through a real-mode to protected-mode kernel entry.

    Here KVM guests hang right there (nested virtualisation is broken), so "/dev/kvm opens"
    proves nothing. iPXE's ``ipxe.lkrn`` is booted as a Linux kernel with no NIC: it finds
    nothing to boot and returns to SeaBIOS, which then logs "Booting from Hard Disk" on its
    debug port. Seeing that line after the ROM entry means the guest ran; a timeout means not.
    """
    if not os.access("/dev/kvm", os.R_OK | os.W_OK) or not PROBE_KERNEL.exists():
        return False
    argv = [
        QEMU, "-accel", "kvm", "-m", "64", "-display", "none", "-vga", "none",
        "-serial", "none", "-monitor", "none", "-nic", "none", "-no-reboot",
        "-kernel", str(PROBE_KERNEL),
        # SeaBIOS logs to the debug port 0x402 (not -debugcon's default 0xe9).
        "-chardev", "stdio,id=dbg", "-device", "isa-debugcon,iobase=0x402,chardev=dbg",
    ]  # fmt: skip
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    except OSError:
        return False
    seen = b""
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        while time.monotonic() < deadline and proc.poll() is None:
            chunk = proc.stdout.read(65536)
            if chunk:
                seen += chunk
                after_rom = seen.partition(b"Booting from ROM")[2]
                if b"Booting from Hard Disk" in after_rom:
                    return True
            else:
                time.sleep(0.05)
        return False
    finally:
        proc.kill()
        proc.wait()


def choose_accelerator(cache_dir: Path, probe_timeout: float = 10.0) -> str:
    """Return "kvm" if a KVM guest really runs here, else "tcg"; probed once per QEMU and kernel.

    ``VMLAB_ACCEL=kvm|tcg`` overrides the probe.
    """
    forced = os.environ.get("VMLAB_ACCEL")
    if forced in ("kvm", "tcg"):
        return forced
    key = f"{_qemu_version()} | {platform.release()}"
    cache = cache_dir / "accel.json"
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key and cached.get("accel") in ("kvm", "tcg"):
            return cached["accel"]
    except (OSError, ValueError):
        pass
    accel = "kvm" if _kvm_boots_probe(probe_timeout) else "tcg"
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "accel": accel}))
    tmp.replace(cache)
    return accel


# ---- machine -----------------------------------------------------------------------------------


def create_disk(path: Path, size: str = "2G") -> None:
    # qcow2 grows on write: a "2G" disk costs a few hundred KB until the guest writes to it.
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", str(path), size],
        check=True,
        capture_output=True,
    )


def create_uefi_vars(path: Path, arch: str = "amd64", tpm: bool = False) -> None:
    """``tpm``: the 4 MB store (OVMF's measured-boot and Secure Boot builds use it)."""
    """Each UEFI machine gets its own copy of the variable store, as a real board has."""
    vars_file = AAVMF_VARS if arch == "arm64" else OVMF_VARS_4M if tpm else OVMF_VARS
    if not vars_file.exists():
        pkg = "qemu-efi-aarch64" if arch == "arm64" else "ovmf"
        raise QemuError(f"{vars_file} is missing: install the Debian package {pkg}")
    shutil.copyfile(vars_file, path)


def create_tpm(state_dir: Path) -> None:
    """A machine's TPM 2.0, made once as at the factory: swtpm_setup with an EK and its
    certificate (swtpm's local CA), SHA-256 PCR bank. It keeps its state for the lab's life."""
    state_dir.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["swtpm_setup", "--tpm2", "--tpmstate", str(state_dir), "--create-ek-cert",
         "--overwrite", "--pcr-banks", "sha256"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if r.returncode != 0:
        raise QemuError(f"swtpm_setup failed: {r.stderr.strip() or r.stdout.strip()}")


def tpm_command_line(state_dir: Path, socket: Path) -> list[str]:
    """swtpm serving one machine's TPM on ``socket`` for as long as the lab lives (QEMU resets
    it at every machine reset, as a board resets its TPM)."""
    return [SWTPM, "socket", "--tpm2", "--tpmstate", f"dir={state_dir}",
            "--ctrl", f"type=unixio,path={socket}"]  # fmt: skip


def serial_socket(serial_log: Path) -> Path:
    """Where a machine's serial port listens, next to its serial log."""
    return serial_log.with_name(serial_log.name.removesuffix(".log") + ".sock")


def command_line(spec: MachineSpec, accel: str) -> list[str]:
    if spec.arch == "arm64":
        return arm64_command_line(spec)
    machine_type = "q35" if spec.firmware == "uefi" else "pc"
    if spec.secure_boot:
        machine_type += ",smm=on"
    argv = [
        QEMU,
        "-name", f"{spec.name},process=vmlab-{spec.name}",
        "-accel", accel,
        # graphics=off makes SeaBIOS use the serial port as its console (sercon).
        "-machine", f"{machine_type},graphics=off",
        "-m", str(spec.memory_mb),
        "-smp", str(spec.cpus),
        "-uuid", spec.uuid,
        "-smbios", f"type=1,manufacturer=vm-lab,product=vm-lab {spec.firmware},"
                   f"serial={spec.serial_number or spec.name},uuid={spec.uuid}",
        "-nodefaults", "-display", "none", "-vga", "none",
        "-S", "-no-shutdown",
        # The serial port is a unix socket (the virtual BMC's Serial-over-LAN end) that QEMU
        # also logs, whether or not anyone is connected.
        "-chardev", f"socket,id=serial0,path={serial_socket(spec.serial_log)},server=on,"
                    f"wait=off,logfile={spec.serial_log},logappend=on",
        "-serial", "chardev:serial0",
        "-monitor", "none",
        "-qmp", f"unix:{spec.qmp_bmc},server=on,wait=off",
        "-qmp", f"unix:{spec.qmp},server=on,wait=off",
        "-netdev", f"tap,id=net0,ifname={spec.tap},script=no,downscript=no",
        # Firmware default: disk first, then network, like a server with PXE fallback.
        "-device", f"virtio-net-pci,id={NIC_ID},netdev=net0,mac={spec.mac},bootindex=2"
                   + ("" if spec.nic_rom else ",romfile="),
        "-drive", f"file={spec.disk},if=none,id=drive0,format=qcow2,cache=unsafe",
        "-device", f"virtio-blk-pci,id={DISK_ID},drive=drive0,bootindex=1"
                   + (f",serial={disk_serial(spec, 0)}" if spec.extra_disks else ""),
        # An empty CD drive on the board's IDE (pc) or AHCI (q35) bus.
        "-drive", "if=none,id=cddrive,media=cdrom,readonly=on",
        "-device", f"ide-cd,id={CD_ID},drive=cddrive",
        *extra_device_args(spec),
    ]  # fmt: skip
    if spec.rng:
        # A hardware RNG, as servers have (RDRAND, a TPM): metald's iPXE seeds TLS from the
        # firmware's RNG protocol, and without one spends seconds gathering entropy itself.
        argv += ["-object", "rng-random,id=rng0,filename=/dev/urandom",
                 "-device", "virtio-rng-pci,rng=rng0"]  # fmt: skip
    if spec.firmware == "uefi":
        if spec.uefi_vars is None:
            raise QemuError(f"{spec.name}: a UEFI machine needs its variable store")
        code = OVMF_CODE_4M if spec.tpm_socket else OVMF_CODE
        if spec.secure_boot:  # only SMM code may write the variables (the guest OS cannot)
            code = OVMF_CODE_SECBOOT
            argv += ["-global", "driver=cfi.pflash01,property=secure,value=on"]
        argv += [
            "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={code}",
            "-drive", f"if=pflash,format=raw,unit=1,file={spec.uefi_vars}",
        ]  # fmt: skip
        if spec.tpm_socket is not None:
            argv += [
                "-chardev", f"socket,id=chrtpm,path={spec.tpm_socket}",
                "-tpmdev", "emulator,id=tpm0,chardev=chrtpm",
                "-device", "tpm-tis,tpmdev=tpm0",
            ]  # fmt: skip
    else:
        # SeaBIOS halts on "No bootable device"; retry like a server that loops on PXE.
        argv += ["-boot", "reboot-timeout=5000"]
    return argv


def arm64_command_line(spec: MachineSpec) -> list[str]:
    """An arm64 UEFI machine: the same devices, serial, QMP and boot order as an x86 one, on
    QEMU's virt board with AAVMF. TCG only (no arm64 KVM on an x86 host). Its NIC carries no
    option ROM (QEMU's is x86 iPXE, which AAVMF cannot run): the firmware's own PXE boots it,
    as a Grace tray's does. The CD drive sits on virtio-scsi (virt has no IDE or AHCI)."""
    if spec.firmware != "uefi" or spec.uefi_vars is None:
        raise QemuError(f"{spec.name}: an arm64 machine boots UEFI and needs its variable store")
    argv = [
        QEMU_ARM64,
        "-name", f"{spec.name},process=vmlab-{spec.name}",
        "-accel", "tcg",
        "-machine", "virt",
        "-cpu", ARM64_CPU,
        "-m", str(spec.memory_mb),
        "-smp", str(spec.cpus),
        "-uuid", spec.uuid,
        "-smbios", f"type=1,manufacturer=vm-lab,product=vm-lab arm64,"
                   f"serial={spec.serial_number or spec.name},uuid={spec.uuid}",
        "-nodefaults", "-display", "none",
        "-S", "-no-shutdown",
        "-chardev", f"socket,id=serial0,path={serial_socket(spec.serial_log)},server=on,"
                    f"wait=off,logfile={spec.serial_log},logappend=on",
        "-serial", "chardev:serial0",
        "-monitor", "none",
        "-qmp", f"unix:{spec.qmp_bmc},server=on,wait=off",
        "-qmp", f"unix:{spec.qmp},server=on,wait=off",
        "-netdev", f"tap,id=net0,ifname={spec.tap},script=no,downscript=no",
        "-device", f"virtio-net-pci,id={NIC_ID},netdev=net0,mac={spec.mac},bootindex=2,romfile=",
        "-drive", f"file={spec.disk},if=none,id=drive0,format=qcow2,cache=unsafe",
        "-device", f"virtio-blk-pci,id={DISK_ID},drive=drive0,bootindex=1",
        "-device", "virtio-scsi-pci,id=scsi0",
        "-drive", "if=none,id=cddrive,media=cdrom,readonly=on",
        "-device", f"scsi-cd,id={CD_ID},drive=cddrive,bus=scsi0.0",
        "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={AAVMF_CODE}",
        "-drive", f"if=pflash,format=raw,unit=1,file={spec.uefi_vars}",
    ]  # fmt: skip
    if spec.rng:
        argv += ["-object", "rng-random,id=rng0,filename=/dev/urandom",
                 "-device", "virtio-rng-pci,rng=rng0"]  # fmt: skip
    return argv


def wait_for_socket(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise QemuError(f"QEMU exited with {proc.returncode}: {_tail(log)}")
        if path.exists():
            return
        time.sleep(0.05)
    raise QemuError(f"QEMU made no QMP socket {path} in {timeout:.0f} s: {_tail(log)}")


def _tail(log: Path, size: int = 2000) -> str:
    try:
        text = log.read_text(errors="replace")[-size:]
    except OSError:
        return "(no log)"
    # QEMU warns about CPU features TCG lacks on every start; they only hide the real error.
    return "\n".join(ln for ln in text.splitlines() if not re.search(r"warning: TCG", ln))
