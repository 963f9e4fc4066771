"""CPU architectures, by Debian's names (amd64, arm64): what machines, images and claims say.

A machine's architecture comes from its agent (``uname -m``) or, before its first inventory,
from the firmware DHCP saw (option 93). Images declare theirs; a machine boots only an image
built for its own. Pure.
"""

from __future__ import annotations

AMD64 = "amd64"
ARM64 = "arm64"
ARCHES = (AMD64, ARM64)
#: What an image that declares no architecture is for (every image before arm64 was).
DEFAULT = AMD64

_UNAME = {"x86_64": AMD64, "amd64": AMD64, "aarch64": ARM64, "arm64": ARM64}
#: Firmware names recorded from DHCP option 93 (metald.boot.dhcp.bootfile.Arch).
_FIRMWARE = {"bios": AMD64, "uefi-x64": AMD64, "uefi-arm64": ARM64}
#: Where an architecture's discovery/wipe files live under the boot assets folder (amd64's at
#: the top, as always; ``python -m bootassets build --arch arm64 --install``).
ASSET_PREFIX = {AMD64: "", ARM64: "arm64/"}
#: The serial console of the architecture's boards (Grace and QEMU's virt board: a PL011).
CONSOLE = {AMD64: "ttyS0", ARM64: "ttyAMA0"}
#: iPXE's ``${buildarch}`` for each (amd64's BIOS builds say i386: the script checks only
#: "arm64 or not").
IPXE_BUILDARCH = {AMD64: "x86_64", ARM64: "arm64"}


def from_uname(machine: str | None) -> str | None:
    """``uname -m`` (x86_64, aarch64) as Debian's name; None when unknown."""
    return _UNAME.get((machine or "").strip().lower())


def from_firmware(firmware: str | None) -> str | None:
    """The architecture a DHCP firmware name implies (uefi-ia32 and unknown: None)."""
    return _FIRMWARE.get(firmware or "")


def of_machine(arch: str | None, firmware: str | None) -> str:
    """A machine's architecture: as recorded, else from its firmware, else amd64."""
    return arch or from_firmware(firmware) or DEFAULT
