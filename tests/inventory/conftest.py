"""Shared paths and builders for the inventory tests."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "gpu"
AGENT = ROOT / "bootassets" / "agent" / "metald-agent"
BOOT_ID = "0f1e2d3c-4b5a-4678-9abc-def012345678"


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()


def nvidia_smi_q_gpus(text: str) -> list[dict[str, str]]:
    """Product Name, Device Id and Bus Id of each GPU in the first ``nvidia-smi -q`` section."""
    if "# $ nvidia-smi -q\n" in text:  # capture bundles: several commands, one "-q" section each
        text = text.split("# $ nvidia-smi -q\n", 1)[1].split("\n# $ ", 1)[0]
    gpus: list[dict[str, str]] = []
    for line in text.splitlines():
        m = re.match(r"^\s*(Product Name|Device Id|Bus Id)\s+: (.*)$", line)
        if not m:
            continue
        if m[1] == "Product Name":
            gpus.append({})
        if gpus and m[1] not in gpus[-1]:
            gpus[-1][m[1]] = m[2].strip()
    return gpus


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


@pytest.fixture
def valid_payload() -> dict[str, Any]:
    return payload()


@pytest.fixture(scope="session")
def built_assets() -> Path:
    """The discovery image, built once into the cache (about 25 s the first time, then reused)."""
    import shutil

    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("building boot assets needs apt-get and dpkg-deb (Debian)")
    from bootassets.build import ensure_built

    return ensure_built()
