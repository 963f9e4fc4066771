"""Inventory payloads as the discovery agent posts them, for tests and benchmarks.

``payload`` is a small valid payload to change key by key; ``nvidia_gpus`` the PCI functions
of a GPU board; ``h100_server`` a whole 8 x H100 SXM server of a simulated fleet.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

BOOT_ID = "0f1e2d3c-4b5a-4678-9abc-def012345678"
NVIDIA = "0x10de"
H100_SXM = "0x2330"  # GH100 [H100 SXM5 80GB]


def nvidia_gpus(
    buses: Iterable[int], device: str = H100_SXM, **fields: Any
) -> list[dict[str, Any]]:
    """One PCI function per bus for NVIDIA GPUs (3D controller class); ``fields`` adds keys."""
    return [
        {
            "address": f"0000:{bus:02x}:00.0",
            "vendor": NVIDIA,
            "device": device,
            "class": "0x030200",
            **fields,
        }
        for bus in buses
    ]


def payload(**over: Any) -> dict[str, Any]:
    """A small valid payload; keyword arguments replace top-level keys."""
    base: dict[str, Any] = {
        "schema_version": 1,
        "agent_version": "1.0",
        "machine_id": "m-1",
        "boot_id": BOOT_ID,
        "sequence": 1,
        "system": {
            "vendor": "Dell Inc.",
            "product": "PowerEdge XE9680",
            "serial": "HSR8X04",
            "uuid": "4C4C4544-0053-5210-8038-C8C04F583034",
        },
        "cpu": {
            "model": "Intel(R) Xeon(R) Platinum 8480+",
            "logical": 224,
            "sockets": 2,
            "cores": 112,
        },
        "memory": {"meminfo_total_kb": 2113000000, "online_bytes": 2199023255552},
        "disks": [
            {
                "name": "nvme0n1",
                "size_bytes": 3840755982336,
                "model": "Dell Ent NVMe",
                "serial": "S6",
                "rotational": False,
            }
        ],
        "nics": [
            {
                "name": "eno1",
                "mac": "AA:BB:CC:00:11:22",
                "driver": "bnxt_en",
                "link": True,
                "speed_mbps": 25000,
                "pci_address": "0000:4b:00.0",
            }
        ],
        "pci": [],
        "raw": {},
    }
    base.update(over)
    return base


def h100_server(
    i: int, mac: str, *, machine_id: str | None, boot_id: str, sequence: int
) -> dict[str, Any]:
    """A schema v1 payload as the discovery agent posts it for an 8 x H100 SXM server: machine
    number ``i`` of a fleet (serials, UUID and other MACs derive from it), PXE NIC ``mac``."""
    gpus = nvidia_gpus(
        (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB),
        subsystem_vendor=NVIDIA,
        subsystem_device="0x16c1",
        driver=None,
    )
    switches = [
        {
            "address": f"0000:{bus:02x}:00.0",
            "vendor": "0x10de",
            "device": "0x22a3",
            "class": "0x068000",
            "subsystem_vendor": "0x10de",
            "subsystem_device": "0x1796",
            "driver": None,
        }
        for bus in (0x05, 0x06, 0x07, 0x08)
    ]
    cx7 = [
        {
            "address": f"0000:{bus:02x}:00.0",
            "vendor": "0x15b3",
            "device": "0x1021",
            "class": "0x020700",
            "subsystem_vendor": "0x15b3",
            "subsystem_device": "0x0041",
            "driver": "mlx5_core",
        }
        for bus in (0x1A, 0x3C, 0x4D, 0x5E, 0x9C, 0xBC, 0xCC, 0xDC)
    ]
    other = [
        {
            "address": "0000:00:00.0",
            "vendor": "0x8086",
            "device": "0x09a2",
            "class": "0x088000",
            "driver": None,
        },
        {
            "address": "0000:02:00.0",
            "vendor": "0x1a03",
            "device": "0x2000",
            "class": "0x030000",
            "driver": "ast",
        },
        {
            "address": "0000:04:00.0",
            "vendor": "0x14e4",
            "device": "0x165f",
            "class": "0x020000",
            "driver": "tg3",
        },
    ] + [
        {
            "address": f"0000:{bus:02x}:00.0",
            "vendor": "0x144d",
            "device": "0xa824",
            "class": "0x010802",
            "driver": "nvme",
        }
        for bus in (0x61, 0x62, 0x63)
    ]
    nics = [
        {
            "name": "eno1",
            "mac": mac,
            "driver": "tg3",
            "link": True,
            "speed_mbps": 1000,
            "pci_address": "0000:04:00.0",
        },
        {
            "name": "eno2",
            "mac": f"b0:7b:26:{i >> 16 & 255:02x}:{i >> 8 & 255:02x}:{i & 255:02x}",
            "driver": "tg3",
            "link": False,
            "speed_mbps": None,
            "pci_address": "0000:04:00.1",
        },
    ]
    disks = [
        {
            "name": f"nvme{n}n1",
            "size_bytes": 3840755982336,
            "model": "SAMSUNG MZQL23T8HCLS-00A07",
            "serial": f"S64HNE0R{i:06d}{n}",
            "wwn": None,
            "rotational": False,
            "removable": False,
        }
        for n in range(3)
    ]
    lan = (
        "Set in Progress         : Set Complete\n"
        "IP Address Source       : DHCP Address\n"
        f"IP Address              : 10.78.{i >> 8 & 255}.{i & 255}\n"
        "Subnet Mask             : 255.255.0.0\n"
        f"MAC Address             : 3c:ec:ef:{i >> 16 & 255:02x}:{i >> 8 & 255:02x}:{i & 255:02x}\n"
        "Default Gateway IP      : 10.78.0.1\n"
        "802.1q VLAN ID          : Disabled\n"
    )
    return {
        "schema_version": 1,
        "agent_version": "1.0",
        "machine_id": machine_id,
        "boot_id": boot_id,
        "sequence": sequence,
        "system": {
            "vendor": "Supermicro",
            "product": "SYS-821GE-TNHR",
            "serial": f"S{900000 + i}",
            "uuid": str(uuid.UUID(int=(0x4C4C4544 << 96) | i)),
            "sku": "To Be Filled By O.E.M.",
            "family": "SMC X13",
            "board_vendor": "Supermicro",
            "board_product": "X13DEG-OAD",
            "board_serial": f"OM{i:08d}",
            "chassis_serial": f"C8210{i:06d}",
            "bios_vendor": "American Megatrends International, LLC.",
            "bios_version": "2.1",
        },
        "cpu": {
            "model": "Intel(R) Xeon(R) Platinum 8480+",
            "logical": 224,
            "sockets": 2,
            "cores": 112,
        },
        "memory": {"meminfo_total_kb": 2113175552, "online_bytes": 2199023255552},
        "disks": disks,
        "nics": nics,
        "pci": other + switches + cx7 + gpus,
        "raw": {"ipmitool_lan_print": lan},
    }
