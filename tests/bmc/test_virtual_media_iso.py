"""The virtual-media boot ISO (bootassets.iso): built from Debian's iPXE ISO, booted from a
virtual CD by QEMU (TCG, BIOS), its embedded script takes an address by DHCP and fetches the
machine's script from the metald URL baked in. QEMU's user network is restricted (no host
network); one guest forward leads to this test's HTTP server on loopback."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from bootassets import iso as boot_iso

pytestmark = pytest.mark.skipif(
    shutil.which("qemu-system-x86_64") is None or not boot_iso.IPXE_ISO.is_file(),
    reason="needs qemu-system-x86_64 and Debian's ipxe package",
)


def test_script_refuses_a_url_that_could_inject_ipxe_commands() -> None:
    with pytest.raises(boot_iso.IsoError):
        boot_iso.boot_script("http://metald\nshell")
    with pytest.raises(boot_iso.IsoError):
        boot_iso.boot_script("http://metald/${x}")
    assert "chain --autofree http://10.0.0.1:8081/boot/${mac:hexhyp}.ipxe" in (
        boot_iso.boot_script("http://10.0.0.1:8081/")
    )


@pytest.fixture
async def metald_http() -> AsyncIterator[tuple[int, asyncio.Queue[str]]]:
    asked: asyncio.Queue[str] = asyncio.Queue()

    async def script(request: web.Request) -> web.Response:
        await asked.put(request.path)
        return web.Response(text="#!ipxe\necho reached metald\nsleep 600\n")

    app = web.Application()
    app.router.add_get("/boot/{name}", script)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield site._server.sockets[0].getsockname()[1], asked  # type: ignore[union-attr]
    await runner.cleanup()


async def test_a_machine_booted_from_the_iso_asks_metald_for_its_script(
    tmp_path: Path, metald_http
) -> None:  # type: ignore[no-untyped-def]
    port, asked = metald_http
    image = boot_iso.build_iso("http://10.0.2.100", tmp_path / "metald-boot.iso")
    assert b"INITRD metald.ipxe" in boot_iso.read_file(image, "isolinux.cfg")
    qemu = subprocess.Popen(
        [
            "qemu-system-x86_64",
            "-accel", "tcg", "-m", "256", "-display", "none", "-serial", "null",
            "-cdrom", str(image), "-boot", "d",
            "-nic",
            "user,restrict=on,model=e1000,mac=52:54:00:aa:bb:01,"
            f"guestfwd=tcp:10.0.2.100:80-tcp:127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        # A bound for a broken boot only (TCG on a loaded host): the test waits on the request.
        path = await asyncio.wait_for(asked.get(), timeout=240)
        assert path == "/boot/52-54-00-aa-bb-01.ipxe"
    finally:
        qemu.kill()
        qemu.wait()


@pytest.mark.skipif(shutil.which("mcopy") is None, reason="needs mtools")
def test_with_metalds_ipxe_the_iso_boots_uefi_machines_into_the_script(tmp_path: Path) -> None:
    """Given metald's ipxe.efi, the ISO's El Torito EFI entry is a FAT image holding it as the
    removable-media boot file and the boot's script as /metald.ipxe (what metald's embedded
    script runs when iPXE starts from a file system); the BIOS entry is isolinux as before.
    Fails on the old code (the EFI image was Debian's, without the script)."""
    import io

    import pycdlib

    from bootassets.ipxe import MEDIA_SCRIPT

    efi = tmp_path / "ipxe.efi"
    efi.write_bytes(b"MZ" + b"metald's ipxe.efi" * 1000)
    script = boot_iso.boot_script("https://10.0.0.1:8443", "/boot/n/m1/abc.ipxe")
    out = tmp_path / "boot.iso"
    with open(out, "wb") as f:
        boot_iso.write_iso(f, script, efi=efi)
    assert boot_iso.read_file(out, "metald.ipxe").decode() == script  # BIOS: isolinux's initrd
    iso = pycdlib.PyCdlib()
    iso.open(str(out))
    try:
        catalog = iso.eltorito_boot_catalog
        (section,) = catalog.sections
        assert section.platform_id == 0xEF  # UEFI
        buf = io.BytesIO()
        iso.get_file_from_iso_fp(buf, iso_path=boot_iso.EFI_IMG)
    finally:
        iso.close()
    img = tmp_path / "efi.img"
    img.write_bytes(buf.getvalue())
    for name, want in (("EFI/BOOT/BOOTX64.EFI", efi.read_bytes()), (MEDIA_SCRIPT, script.encode())):
        got = subprocess.run(
            ["mtype", "-i", str(img), f"::/{name}"], capture_output=True, check=True
        ).stdout
        assert got == want, name


def test_uefi_media_needs_metalds_ipxe_that_runs_the_script(tmp_path: Path) -> None:
    from bootassets.ipxe import embedded_script
    from metald.provision.media_boot import media_efi

    assert media_efi(str(tmp_path), "debian") == (None, 'boot.ipxe = "debian"')
    path, why = media_efi(str(tmp_path), "auto")
    assert path is None and why and "not built" in why
    (tmp_path / "ipxe").mkdir()
    (tmp_path / "ipxe" / "ipxe.efi").write_bytes(b"MZ")
    (tmp_path / "ipxe" / "metald.ipxe").write_text("#!ipxe\ndhcp\nchain ${filename}\n")
    path, why = media_efi(str(tmp_path), "auto")
    assert path is None and why and "predates" in why
    (tmp_path / "ipxe" / "metald.ipxe").write_text(embedded_script())
    if shutil.which("mcopy"):
        assert media_efi(str(tmp_path), "auto") == (tmp_path / "ipxe" / "ipxe.efi", None)


def test_with_metalds_lkrn_the_iso_boots_bios_machines_into_metalds_ipxe(tmp_path: Path) -> None:
    """Given metald's ipxe.lkrn, the ISO's BIOS side (isolinux, its El Torito entry) loads it
    instead of Debian's ipxe.krn, with the boot's script as its initrd: metald's embedded
    script runs that initrd (``<INITRD>``), so the nonce URL is fetched over HTTPS pinned to
    metald's CA. Debian's EFI image stays when there is no ipxe.efi. Fails on the old code
    (always Debian's ipxe.krn, which trusts iPXE's own root CA)."""
    import io

    import pycdlib

    lkrn = tmp_path / "ipxe.lkrn"
    lkrn.write_bytes(b"\xeb\x3c" + b"metald's ipxe.lkrn" * 3000)
    script = boot_iso.boot_script("https://10.0.0.1:8443", "/boot/n/m1/abc.ipxe")
    out = tmp_path / "boot.iso"
    with open(out, "wb") as f:
        boot_iso.write_iso(f, script, bios=lkrn)
    cfg = boot_iso.read_file(out, "isolinux.cfg").decode()
    assert " KERNEL ipxe.lkrn\n" in cfg and " INITRD metald.ipxe\n" in cfg
    assert boot_iso.read_file(out, "ipxe.lkrn") == lkrn.read_bytes()
    assert boot_iso.read_file(out, "metald.ipxe").decode() == script
    iso = pycdlib.PyCdlib()
    iso.open(str(out))
    try:
        names = {c.file_identifier() for c in iso.list_children(iso_path="/")}
        catalog = iso.eltorito_boot_catalog
        assert catalog.validation_entry.platform_id == 0  # BIOS first: isolinux
        (section,) = catalog.sections
        assert section.platform_id == 0xEF
        buf = io.BytesIO()
        iso.get_file_from_iso_fp(buf, iso_path=boot_iso.EFI_IMG)
    finally:
        iso.close()
    assert b"IPXE.KRN;1" not in names  # Debian's iPXE is not on it
    src = pycdlib.PyCdlib()
    src.open(str(boot_iso.IPXE_ISO))
    try:
        debian = io.BytesIO()
        src.get_file_from_iso_fp(debian, iso_path=boot_iso.EFI_IMG)
    finally:
        src.close()
    assert buf.getvalue() == debian.getvalue()


def test_bios_media_needs_metalds_lkrn_that_runs_the_initrd(tmp_path: Path) -> None:
    from bootassets.ipxe import embedded_script
    from metald.provision.media_boot import media_bios

    assert media_bios(str(tmp_path), "debian") == (None, 'boot.ipxe = "debian"')
    path, why = media_bios(str(tmp_path), "auto")
    assert path is None and why and "no ipxe.lkrn" in why
    (tmp_path / "ipxe").mkdir()
    (tmp_path / "ipxe" / "ipxe.lkrn").write_bytes(b"lkrn")
    (tmp_path / "ipxe" / "metald.ipxe").write_text("#!ipxe\ndhcp\nchain ${filename}\n")
    path, why = media_bios(str(tmp_path), "auto")
    assert path is None and why and "predates" in why
    (tmp_path / "ipxe" / "metald.ipxe").write_text(embedded_script())
    assert media_bios(str(tmp_path), "auto") == (tmp_path / "ipxe" / "ipxe.lkrn", None)
