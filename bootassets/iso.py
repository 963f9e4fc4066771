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

IPXE_ISO = Path("/usr/lib/ipxe/ipxe.iso")
SCRIPT_NAME = "METALD.IPXE"
_URL = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9._~/\-]*)?$")


class IsoError(Exception):
    pass


def boot_script(boot_url: str) -> str:
    """The iPXE script the ISO runs: address by DHCP, retried, then metald's script for this
    machine's MAC; on failure it retries rather than falling through to another boot."""
    base = boot_url.rstrip("/")
    if not _URL.match(base):
        raise IsoError(f"boot URL {boot_url!r} is not a plain http(s) URL")
    return (
        "#!ipxe\n"
        ":retry\n"
        "dhcp || goto wait\n"
        f"chain --autofree {base}/boot/${{mac:hexhyp}}.ipxe || goto wait\n"
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


def build_iso(boot_url: str, out: Path, source: Path = IPXE_ISO) -> Path:
    """Write the boot ISO for ``boot_url`` to ``out`` (atomically: a temporary file renamed)."""
    import pycdlib

    if not source.is_file():
        raise IsoError(f"{source} is missing: install Debian's ipxe package")
    script = boot_script(boot_url).encode()
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
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        iso.write(str(tmp))
    finally:
        iso.close()
    tmp.replace(out)
    return out


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
