"""QEMU machines network-booting from metald, proven on the VM's serial console.

- BIOS: SeaBIOS runs the NIC's iPXE ROM; iPXE's DHCP carries user class iPXE, so metald hands
  it the per-machine script URL straight away.
- UEFI: OVMF with the NIC ROM disabled (``romfile=``) uses its own PXE: DHCP with arch 7, TFTP
  of snponly.efi from metald, which chainloads iPXE, which then fetches the script over HTTP.

- UEFI with metald's own iPXE (bootassets/ipxe.py, installed in the assets' ``ipxe/``): the
  same path, side by side with Debian's snponly.efi; no banner wait, the embedded script chains
  to the URL metald's DHCP hands iPXE. Under METALD_LAB_LONG=1: the first run on a machine
  builds iPXE (9-15 minutes on 2 busy cores; cached after).

Each prints the time from power-on to the script (with and without Router Advertisements);
timings are printed, never asserted.
"""

from __future__ import annotations

import os
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


def boot_vm(
    tmp: Path,
    assets: Path,
    *,
    firmware: str,
    ra: bool,
    mac: str,
    api: str = "",
    until: str = MARK,
) -> float:
    """Seconds from power-on until ``until`` shows on the console (and, for MARK, metald
    served the discovery script); ``api``: more [api] lines (TLS)."""
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
            api=api,
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
            # a hardware RNG, as the lab's machines have (vmlab.qemu): iPXE seeds TLS from it
            "-object",
            "rng-random,id=rng0,filename=/dev/urandom",
            "-device",
            "virtio-rng-pci,rng=rng0",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        t0 = time.monotonic()
        took = -1.0
        try:
            while time.monotonic() - t0 < 120:
                if serial.exists() and until in serial.read_text(errors="replace"):
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
    assert took > 0, f"{until!r} never showed; console tail:\n{console[-2000:]}"
    log = (tmp / "metald.log").read_text()
    if until == MARK:
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


@pytest.mark.skipif(not OVMF.exists(), reason="needs ovmf")
@pytest.mark.skipif(
    os.environ.get("METALD_LAB_LONG") != "1",
    reason="builds metald's iPXE on first use (~10 min on 2 cores): METALD_LAB_LONG=1",
)
def test_uefi_firmware_pxe_boots_metalds_own_ipxe(
    tmp_path: Path, assets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bootassets.build import BuildError
    from bootassets.ipxe import find_source, install
    from vmlab.labipxe import built_ipxe

    try:
        find_source()
    except BuildError as e:
        pytest.skip(str(e))
    # metald reads every METALD_* variable as a setting: not this one, which is the tests'
    monkeypatch.delenv("METALD_LAB_LONG")
    debian = boot_vm(tmp_path / "debian", assets, firmware="uefi", ra=True, mac="52:54:00:79:00:05")
    install(built_ipxe(), assets)
    built = boot_vm(tmp_path / "built", assets, firmware="uefi", ra=True, mac="52:54:00:79:00:06")
    log = (tmp_path / "built" / "metald.log").read_text()
    assert "TFTP ipxe/snponly.efi to 10.79.0.100" in log, log[-2000:]
    console = (tmp_path / "built" / "serial.log").read_text(errors="replace")
    assert "metald: chaining to http://10.79.0.1:8080/boot/" in console, console[-2000:]
    assert "Ctrl-B" not in console  # no banner wait
    assert "Ctrl-B" in (tmp_path / "debian" / "serial.log").read_text(errors="replace")
    print(f"UEFI firmware PXE -> iPXE script: Debian's {debian:.1f} s, metald's {built:.1f} s")


@pytest.mark.skipif(not OVMF.exists(), reason="needs ovmf")
@pytest.mark.skipif(
    os.environ.get("METALD_LAB_LONG") != "1",
    reason="builds metald's iPXE on first use (~10 min on 2 cores): METALD_LAB_LONG=1",
)
def test_metalds_ipxe_fetches_its_script_over_https_pinned_to_its_ca(
    tmp_path: Path, assets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """metald's TLS certificate from the CA the iPXE was built with: the script comes over
    HTTPS. The same address answering with another CA's certificate (a man in the middle):
    iPXE refuses it and metald serves nothing."""
    from bootassets.build import BuildError
    from bootassets.ipxe import find_source, install
    from vmlab.labipxe import built_ipxe, server_cert

    try:
        find_source()
    except BuildError as e:
        pytest.skip(str(e))
    # metald reads every METALD_* variable as a setting: not this one, which is the tests'
    monkeypatch.delenv("METALD_LAB_LONG")
    install(built_ipxe(), assets)

    def tls(where: Path, foreign: bool) -> str:
        cert, key = server_cert(where, "10.79.0.1", foreign=foreign)
        return f'tls_cert = "{cert}"\ntls_key = "{key}"\npublic_url = "https://10.79.0.1:8080"\n'

    took = boot_vm(
        tmp_path / "ok", assets, firmware="uefi", ra=True, mac="52:54:00:79:00:07",
        api=tls(tmp_path / "ok-tls", foreign=False),
    )  # fmt: skip
    console = (tmp_path / "ok" / "serial.log").read_text(errors="replace")
    assert "metald: chaining to https://10.79.0.1:8080/boot/" in console, console[-2000:]

    boot_vm(
        tmp_path / "mitm", assets, firmware="uefi", ra=True, mac="52:54:00:79:00:08",
        api=tls(tmp_path / "mitm-tls", foreign=True), until="metald: no boot script yet",
    )  # fmt: skip
    log = (tmp_path / "mitm" / "metald.log").read_text()
    assert "iPXE script for 52:54:00:79:00:08" not in log, log[-2000:]
    # iPXE refused the certificate: its signature does not verify against the CA built in
    # (the man in the middle copied the CA's name, so iPXE finds that CA as the issuer; with
    # the RSA lab CA iPXE says "Result too large", with an EC one it said "Invalid argument")
    fetch = "https://10.79.0.1:8080/boot/52:54:00:79:00:08.ipxe... "
    mitm = (tmp_path / "mitm" / "serial.log").read_text(errors="replace")
    assert fetch in mitm and f"{fetch}ok" not in mitm, mitm[-2000:]
    print(f"UEFI firmware PXE -> iPXE script over pinned HTTPS: {took:.1f} s")
