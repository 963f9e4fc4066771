"""metald's virtual-media boot ISO: Debian's iPXE ISO (``/usr/lib/ipxe/ipxe.iso``, the ipxe
package) remastered with an iPXE script that chains to metald, so a machine booted from its
BMC's virtual CD reaches metald without DHCP boot options.

How it finds metald: the ISO carries metald's boot URL (a deployment's, hence built per
deployment: ``python -m bootassets iso --boot-url URL``). Its script takes an address by DHCP
(plain addressing; no boot options needed) and fetches the machine's script exactly as a PXE
boot does (``/boot/<mac>.ipxe``), so the agent token rides on the first fetch of the boot metald
armed, as for PXE. It carries no secret: one ISO serves every machine.

BIOS: isolinux loads ``ipxe.krn`` with the script as its initrd, which iPXE executes; when
metald's own iPXE is built (``bios=``, its ``ipxe.lkrn``), that instead, whose embedded script
runs the initrd (HTTPS then trusts metald's CA only). UEFI,
when metald's own iPXE is built (``efi=``, its ``ipxe.efi``) and mtools is installed: the ISO's
EFI boot image is a new FAT image holding that ``ipxe.efi`` as ``/EFI/BOOT/BOOTX64.EFI`` and the
same script as ``/metald.ipxe``, which metald's embedded script runs first when iPXE was
started from a file system (bootassets/ipxe.py); HTTPS then trusts metald's CA only. Without
them the EFI image stays Debian's: a UEFI machine booted from it runs iPXE's default (DHCP boot
options), not this script (``efi_unavailable`` says why).

Not hybrid (a virtual CD needs none). Pure Python (pycdlib), no xorriso: a build takes well under a second and needs no cache.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import BinaryIO

IPXE_ISO = Path("/usr/lib/ipxe/ipxe.iso")
SCRIPT_NAME = "METALD.IPXE"
_URL = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9._~/\-]*)?$")
_PATH = re.compile(r"^/[A-Za-z0-9._~/\-]+$")


class IsoError(Exception):
    pass


def boot_script(boot_url: str, script_path: str | None = None) -> str:
    """The iPXE script the ISO runs: address by DHCP, retried, then metald's script: this
    machine's by MAC, or ``script_path`` under ``boot_url`` (a per-boot nonce URL,
    ``/boot/n/<machine>/<nonce>.ipxe``); on failure it retries rather than falling through to
    another boot."""
    base = boot_url.rstrip("/")
    if not _URL.match(base):
        raise IsoError(f"boot URL {boot_url!r} is not a plain http(s) URL")
    if script_path is not None and not _PATH.match(script_path):
        raise IsoError(f"script path {script_path!r} is not a plain absolute path")
    target = f"{base}{script_path}" if script_path else f"{base}/boot/${{mac:hexhyp}}.ipxe"
    return (
        "#!ipxe\n"
        ":retry\n"
        "dhcp || goto wait\n"
        f"chain --autofree {target} || goto wait\n"
        ":wait\n"
        "echo metald boot ISO: no address or no script from " + base + "; retrying\n"
        "sleep 10\n"
        "goto retry\n"
    )


#: metald's own iPXE built as a Linux kernel (bootassets/ipxe.py), on the ISO's BIOS side.
LKRN = "IPXE.LKRN"


def isolinux_cfg(kernel: str = "ipxe.krn") -> str:
    """isolinux loads ``kernel`` (Debian's ipxe.krn, or metald's ipxe.lkrn) with the script as
    its initrd: Debian's iPXE runs it as its first image; metald's embedded script runs it
    (``<INITRD>``) instead of DHCP's boot file."""
    return (
        "SAY metald boot ISO (iPXE)\n"
        "TIMEOUT 0\n"
        "DEFAULT metald\n"
        "LABEL metald\n"
        f" KERNEL {kernel}\n"
        f" INITRD {SCRIPT_NAME.lower()}\n"
    )


def build_iso(
    boot_url: str, out: Path, source: Path = IPXE_ISO, script_path: str | None = None
) -> Path:
    """Write the boot ISO for ``boot_url`` to ``out`` (atomically: a temporary file renamed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        write_iso(f, boot_script(boot_url, script_path), source)
    tmp.replace(out)
    return out


#: The EFI boot image's name in Debian's ISO (its El Torito EFI entry).
EFI_IMG = "/EFI.IMG;1"
#: Where metald's embedded script looks for a virtual-media script (bootassets/ipxe.py
#: MEDIA_SCRIPT), at the root of the file system iPXE was started from.
EFI_SCRIPT = "metald.ipxe"


def efi_unavailable(efi: Path | None) -> str | None:
    """Why the ISO cannot boot UEFI machines into ``efi`` (metald's ipxe.efi), or None."""
    import shutil

    if efi is None or not efi.is_file():
        return "metald's own iPXE is not built (python -m bootassets ipxe --install)"
    if shutil.which("mformat") is None or shutil.which("mcopy") is None:
        return "mtools is not installed (the EFI boot image is a FAT file system)"
    return None


def efi_image(ipxe_efi: bytes, script_text: str) -> bytes:
    """A FAT image (mtools, no root or loop device) holding ``ipxe_efi`` as the removable-media
    boot file ``/EFI/BOOT/BOOTX64.EFI`` and the script as ``/metald.ipxe``."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="metald-efiimg-") as tmp:
        img, efi, script = Path(tmp, "efi.img"), Path(tmp, "bootx64.efi"), Path(tmp, "s.ipxe")
        efi.write_bytes(ipxe_efi)
        script.write_text(script_text)
        kib = (len(ipxe_efi) + len(script_text)) // 1024 + 512  # FAT and directories
        with open(img, "wb") as f:
            f.truncate(kib * 1024)

        def run(*argv: str) -> None:
            r = subprocess.run(argv, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise IsoError(f"{argv[0]} failed: {(r.stderr or r.stdout).strip()}")

        run("mformat", "-i", str(img), "-v", "METALD", "::")
        run("mmd", "-i", str(img), "::/EFI", "::/EFI/BOOT")
        run("mcopy", "-i", str(img), str(efi), "::/EFI/BOOT/BOOTX64.EFI")
        run("mcopy", "-i", str(img), str(script), f"::/{EFI_SCRIPT}")
        return img.read_bytes()


def write_iso(
    f: BinaryIO,
    script_text: str,
    source: Path = IPXE_ISO,
    efi: Path | None = None,
    bios: Path | None = None,
) -> None:
    """Write Debian's iPXE ISO, remastered to run ``script_text``, to the open file ``f``;
    with ``efi`` (metald's ipxe.efi) its EFI boot image runs the script too, with ``bios``
    (metald's ipxe.lkrn) its BIOS side boots metald's iPXE instead of Debian's ipxe.krn."""
    import pycdlib

    if not source.is_file():
        raise IsoError(f"{source} is missing: install Debian's ipxe package")
    if efi is not None or bios is not None:
        efi_img = efi_image(efi.read_bytes(), script_text) if efi is not None else None
        _write_fresh(f, script_text, source, efi_img, bios.read_bytes() if bios else None)
        return
    script = script_text.encode()
    cfg = isolinux_cfg().encode()
    iso = pycdlib.PyCdlib()
    iso.open(str(source))
    try:
        # A virtual CD needs El Torito only; pycdlib cannot rewrite this isohybrid MBR (its
        # EFI partition entry), so the copy is a plain CD image.
        iso.rm_isohybrid()
        iso.rm_file("/ISOLINUX.CFG;1", rr_name="isolinux.cfg", joliet_path="/isolinux.cfg")
        iso.add_fp(
            io.BytesIO(cfg),
            len(cfg),
            "/ISOLINUX.CFG;1",
            rr_name="isolinux.cfg",
            joliet_path="/isolinux.cfg",
        )
        iso.add_fp(
            io.BytesIO(script),
            len(script),
            f"/{SCRIPT_NAME};1",
            rr_name=SCRIPT_NAME.lower(),
            joliet_path=f"/{SCRIPT_NAME.lower()}",
        )
        iso.write_fp(f)
    finally:
        iso.close()


def _write_fresh(
    f: BinaryIO, script_text: str, source: Path, efi_img: bytes | None, lkrn: bytes | None
) -> None:
    """A new ISO from Debian's isolinux and ``lkrn`` (metald's ipxe.lkrn; else Debian's
    ipxe.krn) for BIOS, and ``efi_img`` (else Debian's) as its EFI boot image: El Torito
    cannot have its boot images swapped in place."""
    import pycdlib

    names = ["LDLINUX.C32", "ISOLINUX.BIN"]
    names += [] if lkrn is not None else ["IPXE.KRN"]
    names += [] if efi_img is not None else ["EFI.IMG"]
    src = pycdlib.PyCdlib()
    src.open(str(source))
    try:
        keep = {}
        for name in names:
            buf = io.BytesIO()
            src.get_file_from_iso_fp(buf, iso_path=f"/{name};1")
            keep[name] = buf.getvalue()
    finally:
        src.close()
    kernel = "ipxe.krn" if lkrn is None else LKRN.lower()
    files = {
        **keep,
        **({LKRN: lkrn} if lkrn is not None else {}),
        "ISOLINUX.CFG": isolinux_cfg(kernel).encode(),
        SCRIPT_NAME: script_text.encode(),
        "EFI.IMG": efi_img if efi_img is not None else keep["EFI.IMG"],
    }
    iso = pycdlib.PyCdlib()
    iso.new(interchange_level=3, rock_ridge="1.09", joliet=3, vol_ident="METALD")
    try:
        for name, data in files.items():
            iso.add_fp(
                io.BytesIO(data),
                len(data),
                f"/{name};1",
                rr_name=name.lower(),
                joliet_path=f"/{name.lower()}",
            )
        iso.add_eltorito("/ISOLINUX.BIN;1", "/BOOT.CAT;1", boot_load_size=4, boot_info_table=True)
        iso.add_eltorito(EFI_IMG, "/BOOT.CAT;1", efi=True)
        iso.write_fp(f)
    finally:
        iso.close()


def read_file(iso_path: Path, name: str) -> bytes:
    """A file of an ISO by its Rock Ridge name (tests, checks)."""
    import pycdlib

    iso = pycdlib.PyCdlib()
    iso.open(str(iso_path))
    try:
        buf = io.BytesIO()
        iso.get_file_from_iso_fp(buf, rr_path=f"/{name}")
        return buf.getvalue()
    finally:
        iso.close()
