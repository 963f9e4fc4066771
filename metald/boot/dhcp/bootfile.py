"""Which boot file a client gets, from what it says about itself. Pure.

- option 77 user class ``iPXE``: iPXE is already running; hand it its per-machine script URL,
  unless metald's own iPXE is installed for its architecture and this iPXE is another (a NIC's
  ROM, Debian's: it says ``iPXE``, metald's says ``metald``): it then gets metald's binary by
  TFTP, as a firmware PXE client does, and that one asks again for the script (a foreign iPXE
  could not check metald's certificate).
- option 60 ``HTTPClient`` (UEFI HTTP boot): an HTTP URL of the iPXE EFI binary.
- option 93 architecture: 0 = BIOS (undionly.kpxe over TFTP), 6/7/9 = x86 UEFI, 11 = arm64 UEFI,
  16/19 = UEFI HTTP boot on x64/arm64 (RFC 4578 and the IANA processor architecture registry).
- anything else (no 93 and no PXEClient vendor class) is not network-booting: no boot file.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import StrEnum

from metald.boot.dhcp.packet import DhcpPacket


class Arch(StrEnum):
    BIOS = "bios"
    UEFI_X64 = "uefi-x64"
    UEFI_IA32 = "uefi-ia32"
    UEFI_ARM64 = "uefi-arm64"
    UNKNOWN = "unknown"


_ARCH_CODES = {
    0: Arch.BIOS,
    6: Arch.UEFI_IA32,
    7: Arch.UEFI_X64,
    9: Arch.UEFI_X64,
    11: Arch.UEFI_ARM64,
    16: Arch.UEFI_X64,
    19: Arch.UEFI_ARM64,
}
_HTTP_ARCH_CODES = frozenset({16, 19})


@dataclass(frozen=True)
class ClientKind:
    arch: Arch
    #: Firmware PXE (option 60 PXEClient or option 93 present).
    pxe: bool
    #: UEFI HTTP boot (option 60 HTTPClient or arch 16/19): gets URLs, not TFTP paths.
    http: bool
    #: iPXE is already running (user class iPXE or metald): gets the script URL.
    ipxe: bool
    #: It is metald's own iPXE (user class ``metald``, bootassets/ipxe.py).
    metald_ipxe: bool = False

    @property
    def boots(self) -> bool:
        return self.pxe or self.http or self.ipxe


#: The user class metald's own iPXE sends (bootassets/ipxe.py USER_CLASS).
METALD_USER_CLASS = b"metald"
#: What ``classify`` returns for a client that is not network-booting (the common case).
PLAIN = ClientKind(arch=Arch.UNKNOWN, pxe=False, http=False, ipxe=False)
_BOOT_OPTIONS = (60, 77, 93)


def classify(pkt: DhcpPacket) -> ClientKind:
    opts = pkt.options
    if not (_BOOT_OPTIONS[0] in opts or _BOOT_OPTIONS[1] in opts or _BOOT_OPTIONS[2] in opts):
        return PLAIN  # the common case under load: a client that is not network-booting
    archs = pkt.client_archs
    vc = pkt.vendor_class
    arch = _ARCH_CODES.get(archs[0], Arch.UNKNOWN) if archs else Arch.UNKNOWN
    http = vc.startswith("HTTPClient") or bool(archs and archs[0] in _HTTP_ARCH_CODES)
    if arch is Arch.UNKNOWN and vc.startswith("PXEClient:Arch:"):
        # Some ROMs send the architecture only inside the vendor class string.
        with contextlib.suppress(IndexError, ValueError):
            arch = _ARCH_CODES.get(int(vc.split(":")[2]), Arch.UNKNOWN)
    classes = pkt.user_classes
    ours = METALD_USER_CLASS in classes
    ipxe = ours or b"iPXE" in classes
    pxe = vc.startswith("PXEClient") or bool(archs)
    return ClientKind(arch=arch, pxe=pxe, http=http, ipxe=ipxe, metald_ipxe=ours)


@dataclass(frozen=True)
class BootFiles:
    """Names under the assets folder, and where HTTP boot lives (from BootConfig)."""

    bios: str = "undionly.kpxe"
    uefi_x64: str = "snponly.efi"
    uefi_ia32: str = "ipxe-i386.efi"
    #: "" when there is none to hand out: Debian ships no arm64 iPXE, so without metald's own
    #: build (bootassets/ipxe.py) an arm64 client gets no boot file rather than an x86 one.
    uefi_arm64: str = "snponly-arm64.efi"
    #: Base URL of the HTTP API as machines reach it, e.g. http://10.0.0.1:8080
    http_base: str = ""
    #: Architectures whose file above is metald's own iPXE: another iPXE of one of these is
    #: chainloaded into it instead of getting the script URL.
    chain: frozenset[Arch] = frozenset()

    def script_url(self, mac: str) -> str:
        return f"{self.http_base}/boot/{mac}.ipxe"

    def asset_url(self, name: str) -> str:
        return f"{self.http_base}/boot/assets/{name}"


def boot_file_for(kind: ClientKind, mac: str, files: BootFiles) -> str | None:
    """The value of ``file``/option 67 for this client, or None if it is not booting."""
    if kind.ipxe and (kind.metald_ipxe or kind.arch not in files.chain or kind.http):
        return files.script_url(mac) if files.http_base else None
    name = {
        Arch.BIOS: files.bios,
        Arch.UEFI_X64: files.uefi_x64,
        Arch.UEFI_IA32: files.uefi_ia32,
        Arch.UEFI_ARM64: files.uefi_arm64,
    }.get(kind.arch)
    if kind.arch is Arch.UEFI_ARM64 and not name:
        return None  # no arm64 iPXE: an x86 binary would only fail on the machine
    if kind.http:
        return files.asset_url(name or files.uefi_x64) if files.http_base else None
    if kind.pxe:
        return name or files.bios
    return None
