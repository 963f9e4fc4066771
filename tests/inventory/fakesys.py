"""Fake /sys and /proc trees for running the agent on the host, built from real captures
(lspci -nn / lspci lines, dmidecode output) so the agent reads what those servers showed."""

from __future__ import annotations

import re
from pathlib import Path

#: lspci class names -> class codes, for plain ``lspci`` output that prints no ids.
CLASS_NAMES = {
    "3D controller": 0x0302,
    "VGA compatible controller": 0x0300,
    "Display controller": 0x0380,
    "PCI bridge": 0x0604,
    "Bridge": 0x0680,
    "Ethernet controller": 0x0200,
    "Infiniband controller": 0x0207,
    "Non-Volatile memory controller": 0x0108,
    "USB controller": 0x0C03,
    "DMA controller": 0x0801,
}
VENDOR_NAMES = {
    "NVIDIA Corporation": 0x10DE,
    "Mellanox Technologies": 0x15B3,
    "ASPEED Technology, Inc.": 0x1A03,
    "Intel Corporation": 0x8086,
    "Samsung Electronics Co Ltd": 0x144D,
    "Pericom Semiconductor": 0x12D8,
    "Renesas Technology Corp.": 0x1912,
}

_NN = re.compile(
    r"^(?P<addr>\S+) .*\[(?P<cls>[0-9a-f]{4})\]: .*\[(?P<ven>[0-9a-f]{4}):(?P<dev>[0-9a-f]{4})\]"
)
_PLAIN = re.compile(r"^(?P<addr>\S+) (?P<cls>[^:]+): (?P<rest>.*)$")


def parse_lspci_nn(text: str) -> list[tuple[str, int, int, int]]:
    """(address, vendor, device, 16-bit class) for every ``lspci -nn`` line."""
    out = []
    for line in text.splitlines():
        m = _NN.match(line)
        if m:
            out.append((m["addr"], int(m["ven"], 16), int(m["dev"], 16), int(m["cls"], 16)))
    return out


def parse_lspci_plain(text: str) -> list[tuple[str, int, int, int]]:
    """Plain ``lspci``: only lines naming a known vendor and an unnamed ``Device XXXX``."""
    out = []
    for line in text.splitlines():
        m = _PLAIN.match(line)
        if not m or m["cls"] not in CLASS_NAMES:
            continue
        vendor = next((v for name, v in VENDOR_NAMES.items() if m["rest"].startswith(name)), None)
        dev = re.search(r"\bDevice ([0-9a-f]{4})\b", m["rest"])
        if vendor is not None and dev:
            out.append((m["addr"], vendor, int(dev[1], 16), CLASS_NAMES[m["cls"]]))
    return out


def parse_dmidecode_system(text: str) -> dict[str, str]:
    keys = {
        "Manufacturer": "sys_vendor",
        "Product Name": "product_name",
        "Serial Number": "product_serial",
        "UUID": "product_uuid",
        "Family": "product_family",
        "SKU Number": "product_sku",
    }
    out = {}
    in_system = False
    for line in text.splitlines():
        if line.strip() == "System Information":
            in_system = True
            continue
        if in_system and not line.startswith((" ", "\t")):
            in_system = False
        if in_system:
            k, _, v = line.strip().partition(": ")
            if k in keys:
                out[keys[k]] = v
    return out


class FakeSys:
    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "proc/sys/kernel/random").mkdir(parents=True)
        (root / "sys/bus/pci/devices").mkdir(parents=True)
        (root / "sys/class/net").mkdir(parents=True)
        (root / "sys/class/dmi/id").mkdir(parents=True)
        (root / "sys/block").mkdir(parents=True)
        (root / "sys/devices/system/memory").mkdir(parents=True)

    def write(self, rel: str, text: str) -> None:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    def boot(self, boot_id: str, cmdline: str = "") -> None:
        self.write("proc/sys/kernel/random/boot_id", boot_id + "\n")
        self.write("proc/cmdline", cmdline + "\n")

    def dmi(self, fields: dict[str, str]) -> None:
        for name, value in fields.items():
            self.write(f"sys/class/dmi/id/{name}", value + "\n")

    def cpus(self, model: str, sockets: int, cores: int, threads_per_core: int = 2) -> None:
        blocks, n = [], 0
        for s in range(sockets):
            for _ in range(cores * threads_per_core):
                blocks.append(
                    f"processor\t: {n}\nvendor_id\t: GenuineIntel\nmodel name\t: {model}\nphysical id\t: {s}\ncpu cores\t: {cores}\n"
                )
                n += 1
        self.write("proc/cpuinfo", "\n".join(blocks))

    def memory(self, total_kb: int, block_bytes: int, blocks: int) -> None:
        self.write("proc/meminfo", f"MemTotal:       {total_kb} kB\nMemFree:        1000 kB\n")
        self.write("sys/devices/system/memory/block_size_bytes", f"{block_bytes:x}\n")
        for i in range(blocks):
            self.write(f"sys/devices/system/memory/memory{i}/online", "1\n")

    def pci(
        self, address: str, vendor: int, device: int, cls16: int, driver: str | None = None
    ) -> None:
        d = f"sys/bus/pci/devices/{address}"
        self.write(f"{d}/vendor", f"0x{vendor:04x}\n")
        self.write(f"{d}/device", f"0x{device:04x}\n")
        self.write(f"{d}/class", f"0x{cls16:04x}00\n")
        self.write(f"{d}/subsystem_vendor", "0x10de\n")
        self.write(f"{d}/subsystem_device", "0x147f\n")
        if driver:
            (self.root / "sys/bus/pci/drivers" / driver).mkdir(parents=True, exist_ok=True)
            (self.root / d / "driver").symlink_to(self.root / "sys/bus/pci/drivers" / driver)

    def nic(
        self,
        name: str,
        mac: str,
        pci_address: str,
        driver: str,
        speed: int | str = 25000,
        carrier: str = "1",
    ) -> None:
        dev = self.root / "sys/devices/pci0000:00" / pci_address
        dev.mkdir(parents=True, exist_ok=True)
        (self.root / "sys/bus/pci/drivers" / driver).mkdir(parents=True, exist_ok=True)
        if not (dev / "driver").exists():
            (dev / "driver").symlink_to(self.root / "sys/bus/pci/drivers" / driver)
        n = f"sys/class/net/{name}"
        self.write(f"{n}/address", mac + "\n")
        self.write(f"{n}/carrier", carrier + "\n")
        self.write(f"{n}/speed", f"{speed}\n")
        (self.root / n / "device").symlink_to(dev)

    def ib_port(
        self, dev: str, port: int, gid0: str, node_guid: str, *, layer: str = "InfiniBand"
    ) -> None:
        """An RDMA port as the kernel shows it under /sys/class/infiniband."""
        base = f"sys/class/infiniband/{dev}"
        self.write(f"{base}/node_guid", node_guid + "\n")
        self.write(f"{base}/ports/{port}/gids/0", gid0 + "\n")
        self.write(f"{base}/ports/{port}/link_layer", layer + "\n")
        self.write(f"{base}/ports/{port}/state", "4: ACTIVE\n")
        self.write(f"{base}/ports/{port}/rate", "400 Gb/sec (4X NDR)\n")

    def virtual_nic(self, name: str, mac: str) -> None:
        self.write(f"sys/class/net/{name}/address", mac + "\n")

    def disk(
        self,
        name: str,
        size_bytes: int,
        model: str,
        serial: str,
        rotational: int = 0,
        pci: str | None = None,
    ) -> None:
        """A disk; with ``pci`` its ``device`` is a link into the PCI tree, as the kernel's
        (virtio-blk: .../ADDR/virtio1; NVMe: .../ADDR/nvme/nvme0, namespace 1)."""
        b = f"sys/block/{name}"
        if pci:
            sub = "nvme/nvme0" if name.startswith("nvme") else "virtio1"
            dev = self.root / "sys/devices/pci0000:00/0000:00:01.0" / pci / sub
            dev.mkdir(parents=True)
            (self.root / b).mkdir(parents=True)
            (self.root / b / "device").symlink_to(dev)
            if name.startswith("nvme"):
                self.write(f"{b}/nsid", "1\n")
        self.write(f"{b}/size", f"{size_bytes // 512}\n")
        self.write(f"{b}/device/model", model + "\n")
        self.write(f"{b}/device/serial", serial + "\n")
        self.write(f"{b}/queue/rotational", f"{rotational}\n")
        self.write(f"{b}/removable", "0\n")
