"""metald's virtual-media boot ISO: Debian's iPXE ISO (``/usr/lib/ipxe/ipxe.iso``, the ipxe
package) remastered with an iPXE script that chains to metald, so a machine booted from its
BMC's virtual CD reaches metald without DHCP boot options.

How it finds metald: the ISO carries metald's boot URL (a deployment's, hence built per
deployment: ``python -m bootassets iso --boot-url URL``). Its script takes an address by DHCP
(plain addressing; no boot options needed) and fetches the machine's script exactly as a PXE
boot does (``/boot/<mac>.ipxe``), so the agent token rides on the first fetch of the boot metald
armed, as for PXE. It carries no secret: one ISO serves every machine.

BIOS only: isolinux loads ``ipxe.krn`` with the script as its initrd, which iPXE executes. The
ISO's EFI boot image (a FAT image holding ``ipxe.efi``) is kept unchanged: a UEFI machine booted
from it runs iPXE's default (DHCP boot options), not this script.

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


def isolinux_cfg() -> str:
    return (
        "SAY metald boot ISO (iPXE)\n"
        "TIMEOUT 0\n"
        "DEFAULT metald\n"
        "LABEL metald\n"
        " KERNEL ipxe.krn\n"
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


def write_iso(f: BinaryIO, script_text: str, source: Path = IPXE_ISO) -> None:
    """Write Debian's iPXE ISO, remastered to run ``script_text``, to the open file ``f``."""
    import pycdlib

    if not source.is_file():
        raise IsoError(f"{source} is missing: install Debian's ipxe package")
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
