"""A machine's CPU model name where the kernel prints none: arm64.

x86 kernels print the processor's brand string as /proc/cpuinfo's "model name"; arm64 kernels
print only the first CPU's MIDR_EL1 fields ("CPU implementer", "CPU part", ...). So on arm64:

1. SMBIOS type 4 (the firmware's processor structure, what ``dmidecode -t 4`` decodes) wins
   when it names something: its Processor Version string ("Ampere(R) Altra(R) Processor Q80-30
   CPU @ 3.0GHz"). Placeholders ("Not Specified", "To Be Filled By O.E.M.") and QEMU's default
   (its machine type, "virt-7.2") name nothing.
2. Else the MIDR's implementer and part, through ``IMPLEMENTERS``/``PARTS`` (the same ids as
   the kernel's ``arch/arm64/include/asm/cputype.h`` and util-linux's ``lscpu-arm.c``):
   "ARM Neoverse-V2". The MIDR names the core, not the chip: NVIDIA Grace and AWS Graviton4
   are both Neoverse-V2; Ampere Altra is Neoverse-N1 (AmpereOne has Ampere's own ids).
3. Else an unknown id is kept as it is ("ARM part 0xd99", "implementer 0x99 part 0x001"), so
   machines of one kind still compare equal and an enroll rule can match them.
"""

from __future__ import annotations

import re

from metald.inventory.dmistrings import clean
from metald.inventory.schema import CpuInfo, Midr

#: MIDR implementer codes (bits 31:24).
IMPLEMENTERS = {
    0x41: "ARM",
    0x42: "Broadcom",
    0x43: "Cavium",
    0x46: "Fujitsu",
    0x48: "HiSilicon",
    0x4E: "NVIDIA",
    0x50: "APM",
    0x51: "Qualcomm",
    0x61: "Apple",
    0x6D: "Microsoft",
    0xC0: "Ampere",
}
#: (implementer, part number) -> core or chip name.
PARTS = {
    (0x41, 0xD03): "Cortex-A53",
    (0x41, 0xD04): "Cortex-A35",
    (0x41, 0xD05): "Cortex-A55",
    (0x41, 0xD07): "Cortex-A57",
    (0x41, 0xD08): "Cortex-A72",
    (0x41, 0xD09): "Cortex-A73",
    (0x41, 0xD0A): "Cortex-A75",
    (0x41, 0xD0B): "Cortex-A76",
    (0x41, 0xD0C): "Neoverse-N1",
    (0x41, 0xD0D): "Cortex-A77",
    (0x41, 0xD40): "Neoverse-V1",
    (0x41, 0xD41): "Cortex-A78",
    (0x41, 0xD44): "Cortex-X1",
    (0x41, 0xD47): "Cortex-A710",
    (0x41, 0xD48): "Cortex-X2",
    (0x41, 0xD49): "Neoverse-N2",
    (0x41, 0xD4A): "Neoverse-E1",
    (0x41, 0xD4F): "Neoverse-V2",
    (0x41, 0xD84): "Neoverse-V3",
    (0x41, 0xD8E): "Neoverse-N3",
    (0x43, 0x0A1): "ThunderX",
    (0x43, 0x0AF): "ThunderX2",
    (0x46, 0x001): "A64FX",
    (0x48, 0xD01): "Kunpeng-920",
    (0x4E, 0x003): "Denver 2",
    (0x4E, 0x004): "Carmel",
    (0x50, 0x000): "X-Gene",
    (0xC0, 0xAC3): "AmpereOne",
    (0xC0, 0xAC4): "AmpereOne AC04",
}
#: QEMU's default processor version in SMBIOS type 4 is its machine type: a board, not a CPU.
_QEMU_MACHINE = re.compile(r"^(virt|pc|pc-q35|pc-i440fx|q35|sbsa-ref)(-[0-9.]+)?$")
#: DSP0134 7.5: string numbers in the processor structure.
_TYPE4_MANUFACTURER = 0x07
_TYPE4_VERSION = 0x10
_TYPE4_PART_NUMBER = 0x22


def smbios_type4_strings(raw: bytes) -> dict[str, str | None]:
    """The manufacturer, version and part number strings of an SMBIOS type 4 structure
    (DSP0134 7.5: the formatted area's length at byte 1, string numbers at offsets 07h, 10h
    and 22h (2.3+), the strings after the formatted area, each NUL-terminated). None for an
    absent string, one past the strings ("<BAD INDEX>" in dmidecode) or a malformed table."""
    out: dict[str, str | None] = {"manufacturer": None, "version": None, "part_number": None}
    if len(raw) < 2 or raw[0] != 4:
        return out
    length = raw[1]
    if length <= _TYPE4_VERSION or len(raw) < length:
        return out
    strings = raw[length:].split(b"\0")
    for key, offset in (
        ("manufacturer", _TYPE4_MANUFACTURER),
        ("version", _TYPE4_VERSION),
        ("part_number", _TYPE4_PART_NUMBER),
    ):
        n = raw[offset] if offset < length else 0
        if 0 < n <= len(strings) and strings[n - 1]:
            out[key] = strings[n - 1].decode("ascii", "replace")
    return out


def from_smbios(hex_raw: str | None) -> str | None:
    """The processor's name from SMBIOS type 4: its version, after its manufacturer when the
    version does not start with it ("NVIDIA Grace A02"), and its part number when that says
    more ("Ampere(R) Altra(R) Processor Q80-30"); None when the version names nothing."""
    if not hex_raw:
        return None
    try:
        raw = bytes.fromhex(hex_raw)
    except ValueError:
        return None
    found = smbios_type4_strings(raw)
    name = clean(found["version"])
    if name is None or _QEMU_MACHINE.match(name):
        return None
    maker = clean(found["manufacturer"])
    if maker and maker.upper() != "QEMU" and not name.lower().startswith(maker.lower()):
        name = f"{maker} {name}"
    part = clean(found["part_number"])
    if part and part.lower() not in name.lower():
        name = f"{name} {part}"
    return name[:250]


def _int(text: str | None) -> int | None:
    try:
        return int(text, 0) if text else None
    except ValueError:
        return None


def midr_fields(midr: Midr) -> tuple[int | None, int | None]:
    """(implementer, part): from /proc/cpuinfo's fields, else decoded from MIDR_EL1 itself
    (implementer bits 31:24, part number bits 15:4)."""
    implementer, part = _int(midr.implementer), _int(midr.part)
    whole = _int(midr.midr_el1)
    if whole is not None:
        if implementer is None:
            implementer = (whole >> 24) & 0xFF
        if part is None:
            part = (whole >> 4) & 0xFFF
    return implementer, part


def from_midr(midr: Midr | None) -> str | None:
    """ "ARM Neoverse-V2": the core's vendor and name; an unknown id as it is; None without
    a MIDR."""
    if midr is None:
        return None
    implementer, part = midr_fields(midr)
    if implementer is None or part is None:
        return None
    vendor = IMPLEMENTERS.get(implementer)
    name = PARTS.get((implementer, part))
    if vendor and name:
        return name if name.startswith(vendor) else f"{vendor} {name}"
    if vendor:
        return f"{vendor} part 0x{part:03x}"
    return f"implementer 0x{implementer:02x} part 0x{part:03x}"


def cpu_model(cpu: CpuInfo) -> str | None:
    """The machine's CPU model: "model name" where the kernel prints one (x86), else SMBIOS
    type 4's processor version, else the MIDR's name."""
    return clean(cpu.model) or from_smbios(cpu.smbios_type4) or from_midr(cpu.midr)
