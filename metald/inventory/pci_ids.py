"""PCI vendor:device ids -> names, and which PCI functions are GPUs.

Names come from Debian's ``pci.ids`` (package ``pci.ids``) plus a small supplement for data
center GPUs that file is too old to know (H200, B200, GB200, ...). The supplement's GPU names
are the ones NVIDIA's driver (and so ``nvidia-smi``) reports for each id, so a machine gets the
same ``gpu_model`` whether or not ``nvidia-smi`` ran in the discovery image. Every entry is
sourced in tests/fixtures/gpu/SOURCES.md (pciutils/pciids and NVIDIA's open-gpu-kernel-modules
README); see docs/inventory.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

PCI_IDS_PATH = Path("/usr/share/misc/pci.ids")

NVIDIA = 0x10DE
AMD = 0x1002
GPU_VENDORS = frozenset({NVIDIA, AMD})
#: PCI class codes (base class << 8 | subclass) of display controllers: VGA, 3D, other.
#: NVSwitch is 0x0680 (bridge), ConnectX 0x0200/0x0207: neither is a GPU.
GPU_CLASSES = frozenset({0x0300, 0x0302, 0x0380})


@dataclass(frozen=True)
class GpuModel:
    #: What the vendor's tool reports (nvidia-smi "Product Name", rocm-smi "Card series").
    name: str
    #: Short family for selectors: "A100", "H100", "H200", "B200", "GB200", "L40S", "MI300X".
    family: str


def _g(name: str, family: str) -> GpuModel:
    return GpuModel(name, family)


#: Data-center GPUs by (vendor, device). Names: NVIDIA's supported-GPU table (nv-readme) and
#: pci.ids 2026.08 (see SOURCES.md). Ids with several products per subsystem id take the name
#: of the common (HGX/OEM) subsystem.
GPU_MODELS: dict[tuple[int, int], GpuModel] = {
    (NVIDIA, 0x20B0): _g("NVIDIA A100-SXM4-40GB", "A100"),
    (NVIDIA, 0x20B2): _g("NVIDIA A100-SXM4-80GB", "A100"),
    (NVIDIA, 0x20B5): _g("NVIDIA A100 80GB PCIe", "A100"),
    (NVIDIA, 0x20F1): _g("NVIDIA A100-PCIE-40GB", "A100"),
    (NVIDIA, 0x2330): _g("NVIDIA H100 80GB HBM3", "H100"),
    (NVIDIA, 0x2331): _g("NVIDIA H100 PCIe", "H100"),
    (NVIDIA, 0x2321): _g("NVIDIA H100 NVL", "H100"),
    (NVIDIA, 0x2339): _g("NVIDIA H100", "H100"),
    (NVIDIA, 0x2335): _g("NVIDIA H200", "H200"),
    (NVIDIA, 0x233B): _g("NVIDIA H200 NVL", "H200"),
    (NVIDIA, 0x2342): _g("NVIDIA GH200 120GB", "GH200"),
    (NVIDIA, 0x2901): _g("NVIDIA B200", "B200"),
    (NVIDIA, 0x2941): _g("NVIDIA GB200", "GB200"),
    (NVIDIA, 0x3182): _g("NVIDIA B300 SXM6 AC", "B300"),
    (NVIDIA, 0x31C2): _g("NVIDIA GB300", "GB300"),
    (NVIDIA, 0x26B9): _g("NVIDIA L40S", "L40S"),
    (NVIDIA, 0x26B5): _g("NVIDIA L40", "L40"),
    (NVIDIA, 0x27B8): _g("NVIDIA L4", "L4"),
    (NVIDIA, 0x2BB5): _g("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX PRO 6000"),
    (AMD, 0x74A1): _g("AMD Instinct MI300X", "MI300X"),
    (AMD, 0x74A0): _g("AMD Instinct MI300A", "MI300A"),
    (AMD, 0x74A5): _g("AMD Instinct MI325X", "MI325X"),
    (AMD, 0x74B5): _g("AMD Instinct MI300X VF", "MI300X"),
    (AMD, 0x75A0): _g("AMD Instinct MI350X", "MI350X"),
    (AMD, 0x75A3): _g("AMD Instinct MI355X", "MI355X"),
    (AMD, 0x740C): _g("AMD Instinct MI250X/MI250", "MI250"),
    (AMD, 0x7408): _g("AMD Instinct MI250X", "MI250X"),
    (AMD, 0x740F): _g("AMD Instinct MI210", "MI210"),
    (AMD, 0x738C): _g("AMD Instinct MI100", "MI100"),
}

#: Non-GPU NVIDIA devices newer than Debian's pci.ids that show up on GPU servers.
SUPPLEMENT_NAMES: dict[tuple[int, int], str] = {
    (NVIDIA, 0x22A3): "GH100 [H100 NVSwitch]",
    (NVIDIA, 0x1AF1): "GA100 [A100 NVSwitch]",
}


@dataclass(frozen=True)
class PciNames:
    vendors: dict[int, str]
    devices: dict[tuple[int, int], str]


def parse_pci_ids(text: str) -> PciNames:
    """Parse the pci.ids format: vendor lines, tab-indented device lines; stop at classes."""
    vendors: dict[int, str] = {}
    devices: dict[tuple[int, int], str] = {}
    vendor: int | None = None
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("C "):
            break  # the class list follows the vendor list; we need no names from it
        if not line.startswith("\t"):
            ident, _, name = line.partition("  ")
            try:
                vendor = int(ident, 16)
            except ValueError:
                vendor = None
                continue
            vendors[vendor] = name.strip()
        elif vendor is not None and not line.startswith("\t\t"):
            ident, _, name = line[1:].partition("  ")
            try:
                devices[(vendor, int(ident, 16))] = name.strip()
            except ValueError:
                continue
    return PciNames(vendors, devices)


@lru_cache(maxsize=4)
def load_pci_ids(path: Path = PCI_IDS_PATH) -> PciNames:
    """The host's pci.ids, parsed once; empty when missing (names then come from the supplement)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return PciNames({}, {})
    return parse_pci_ids(text)


def is_gpu(vendor: int, pci_class: int) -> bool:
    """``pci_class`` is the 24-bit class code from sysfs (0x030200) or the 16-bit one (0x0302)."""
    cls16 = pci_class >> 8 if pci_class > 0xFFFF else pci_class
    return vendor in GPU_VENDORS and cls16 in GPU_CLASSES


def gpu_model(vendor: int, device: int, names: PciNames | None = None) -> GpuModel:
    """The model of a GPU: the supplement table, else pci.ids' name, else the raw ids."""
    known = GPU_MODELS.get((vendor, device))
    if known:
        return known
    names = names if names is not None else load_pci_ids()
    vname = {NVIDIA: "NVIDIA", AMD: "AMD"}.get(vendor, f"{vendor:04x}")
    dname = names.devices.get((vendor, device))
    if dname:
        # "GA102GL [A40]" -> family "A40"; unbracketed names are their own family.
        family = dname[dname.find("[") + 1 : dname.rfind("]")] if "[" in dname else dname
        return GpuModel(f"{vname} {dname}", family)
    return GpuModel(f"{vname} device {device:04x}", f"{vendor:04x}:{device:04x}")


def device_name(vendor: int, device: int, names: PciNames | None = None) -> str | None:
    names = names if names is not None else load_pci_ids()
    return SUPPLEMENT_NAMES.get((vendor, device)) or names.devices.get((vendor, device))


def vendor_name(vendor: int, names: PciNames | None = None) -> str | None:
    names = names if names is not None else load_pci_ids()
    return names.vendors.get(vendor)
