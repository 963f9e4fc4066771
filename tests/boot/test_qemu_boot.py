"""QEMU machines network-booting from metald, proven on the VM's serial console.

- BIOS: SeaBIOS runs the NIC's iPXE ROM; iPXE's DHCP carries user class iPXE, so metald hands
  it the per-machine script URL straight away.
- UEFI: OVMF with the NIC ROM disabled (``romfile=``) uses its own PXE: DHCP with arch 7, TFTP
  of snponly.efi from metald, which chainloads iPXE, which then fetches the script over HTTP.

Each prints the time from power-on to the script (with and without Router Advertisements);
timings are printed, never asserted.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from vmlab.labnet import NEED_ROOT, ROOT, BootProcess, namespaces, write_config

pytestmark = [
    pytest.mark.lab,
    pytest.mark.root,
    pytest.mark.skipif(not ROOT, reason=NEED_ROOT),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs qemu-system-x86"),
]

OVMF = Path("/usr/share/ovmf/OVMF.fd")
MARK = "metald: discovery image for"

BOOT = """
[boot]
enabled = true
dhcp_mode = "full"
interfaces = ["br0"]
server_address = "10.79.0.1"
assets_dir = "{assets}"
router_advertisements = {ra}
[[boot.networks]]
name = "lab"
subnet = "10.79.0.0/24"
pool_start = "10.79.0.100"
pool_end = "10.79.0.199"
lease_seconds = 600
interface = "br0"
"""


def boot_vm(tmp: Path, assets: Path, *, firmware: str, ra: bool, mac: str) -> float:
    tmp.mkdir(parents=True, exist_ok=True)
    serial = tmp / "serial.log"
    with namespaces("lab") as ns:
        lab = ns["lab"]
        lab.run(
            "sysctl", "-qw", "net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0"
        )
        lab.run("ip", "link", "add", "br0", "type", "bridge", "forward_delay", "0")
        lab.run("ip", "addr", "add", "10.79.0.1/24", "dev", "br0")
        lab.run("ip", "tuntap", "add", "tap0", "mode", "tap")
        lab.run("ip", "link", "set", "tap0", "master", "br0")
        lab.run("ip", "link", "set", "tap0", "up")
        lab.run("ip", "link", "set", "br0", "up")
        cfg = write_config(
            tmp / "metald.toml",
            state_dir=tmp / "state",
            boot=BOOT.format(assets=assets, ra=str(ra).lower()),
            listen="10.79.0.1:8080",
        )
        proc = BootProcess(lab, cfg, tmp / "metald.log").start()
        nic = f"virtio-net-pci,netdev=n0,mac={mac}"
        fw: list[str] = []
        if firmware == "uefi":
            nic += ",romfile="
            fw = ["-bios", str(OVMF)]
        qemu = lab.popen(
            "qemu-system-x86_64",
            "-accel",
            "tcg",
            "-m",
            "256",
            "-nographic",
            "-monitor",
            "none",
            "-serial",
            f"file:{serial}",
            *fw,
            "-boot",
            "n",
            "-netdev",
            "tap,id=n0,ifname=tap0,script=no,downscript=no",
            "-device",
            nic,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        t0 = time.monotonic()
        took = -1.0
        try:
            while time.monotonic() - t0 < 120:
                if serial.exists() and MARK in serial.read_text(errors="replace"):
                    took = time.monotonic() - t0
                    break
                if qemu.poll() is not None:
                    break
                time.sleep(0.1)
        finally:
            qemu.kill()
            qemu.wait(10)
            proc.stop()
    console = serial.read_text(errors="replace") if serial.exists() else ""
    assert took > 0, f"no iPXE script reached; console tail:\n{console[-2000:]}"
    log = (tmp / "metald.log").read_text()
    assert f"iPXE script for {mac}: discovery" in log, log[-2000:]
    print(f"\n{firmware} RA={'on' if ra else 'off'}: power-on to iPXE script {took:.1f} s")
    return took


def test_bios_ipxe_rom_to_script(tmp_path: Path, assets: Path) -> None:
    with_ra = boot_vm(tmp_path / "a", assets, firmware="bios", ra=True, mac="52:54:00:79:00:01")
    without = boot_vm(tmp_path / "b", assets, firmware="bios", ra=False, mac="52:54:00:79:00:02")
    print(f"BIOS: with RA {with_ra:.1f} s, without {without:.1f} s, ratio {without / with_ra:.2f}")


@pytest.mark.skipif(not OVMF.exists(), reason="needs ovmf")
def test_uefi_firmware_pxe_tftp_chainload_to_script(tmp_path: Path, assets: Path) -> None:
    took = boot_vm(tmp_path, assets, firmware="uefi", ra=True, mac="52:54:00:79:00:03")
    log = (tmp_path / "metald.log").read_text()
    # Firmware PXE took snponly.efi by TFTP (OVMF falls back to UEFI HTTP boot otherwise).
    assert "TFTP snponly.efi to 10.79.0.100" in log, log[-2000:]
    assert "GET /boot/assets/snponly.efi" not in log
    without = boot_vm(
        tmp_path / "no-ra", assets, firmware="uefi", ra=False, mac="52:54:00:79:00:04"
    )
    print(
        f"UEFI (OVMF PXE -> TFTP snponly.efi -> iPXE -> HTTP): with RA {took:.1f} s, "
        f"without {without:.1f} s, ratio {without / took:.2f}"
    )
