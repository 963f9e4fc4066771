"""The discovery image's select-drivers split: what /init loads before DHCP ("network") and what
it loads meanwhile ("others"). Runs the real script under busybox sh against a small module
table and a fake /sys (in-process files, milliseconds; no image build)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bootassets" / "initramfs" / "select-drivers"
BUSYBOX = shutil.which("busybox")

VIRTIO_NET = "pci:v00001AF4d00001000sv00001AF4sd00000001bc02sc00i00"
VIRTIO_BLK = "pci:v00001AF4d00001001sv00001AF4sd00000002bc01sc00i00"
E1000 = "pci:v00008086d0000100Esv00001AF4sd00001100bc02sc00i00"
AHCI = "pci:v00008086d00002922sv00001AF4sd00001100bc01sc06i01"

# The shape bootassets/build.py writes: aliases ("driver match"), closures ("driver deps...
# driver"), load-order, and network (drivers under drivers/net/).
ALIASES = """virtio_pci ^pci:v00001AF4d.*sv.*sd.*bc.*sc.*i.*$
virtio_net *
virtio_blk *
e1000 id:v00008086d0000100E
ahci ^pci:v.*d.*sv.*sd.*bc01sc06i01$
ipmi_si *
"""
CLOSURES = """virtio_pci virtio_ring virtio virtio_pci
virtio_net virtio_ring virtio failover net_failover virtio_net
virtio_blk virtio_ring virtio virtio_blk
e1000 e1000
ahci libata libahci ahci
ipmi_si ipmi_msghandler ipmi_si
"""
LOAD_ORDER = """virtio_ring
virtio
virtio_pci
failover
net_failover
virtio_net
virtio_blk
e1000
libata
libahci
ahci
ipmi_msghandler
ipmi_si
"""


@pytest.fixture
def moddir(tmp_path: Path) -> Path:
    d = tmp_path / "modules"
    d.mkdir()
    (d / "aliases").write_text(ALIASES)
    (d / "closures").write_text(CLOSURES)
    (d / "load-order").write_text(LOAD_ORDER)
    (d / "network").write_text("virtio_net\ne1000\n")
    return d


def select(moddir: Path, sysroot: Path, *modaliases: str, part: str = "") -> list[str]:
    for i, alias in enumerate(modaliases):
        dev = sysroot / f"sys/bus/pci/devices/0000:00:{i:02x}.0"
        dev.mkdir(parents=True, exist_ok=True)
        (dev / "modalias").write_text(alias + "\n")
    args = [BUSYBOX, "sh", str(SCRIPT), str(moddir), str(sysroot)] + ([part] if part else [])
    out = subprocess.run(
        args, capture_output=True, text=True, check=True, env={"PATH": str(Path(BUSYBOX).parent)}
    )
    return out.stdout.split()


pytestmark = pytest.mark.skipif(BUSYBOX is None, reason="needs busybox")


def test_network_part_brings_up_every_nic_including_the_shared_virtio_bus(
    moddir: Path, tmp_path: Path
) -> None:
    """virtio_pci drives both the virtio disk and the virtio NIC: it is network when any of its
    devices is (listed first here, the disk would otherwise decide), or the NIC never appears."""
    devices = (VIRTIO_BLK, VIRTIO_NET, E1000, AHCI)
    everything = select(moddir, tmp_path / "a", *devices)
    network = select(moddir, tmp_path / "a", part="network")
    others = select(moddir, tmp_path / "a", part="others")
    assert network == [
        "virtio_ring", "virtio", "virtio_pci", "failover", "net_failover", "virtio_net", "e1000"
    ]  # fmt: skip
    assert others == ["virtio_blk", "libata", "libahci", "ahci", "ipmi_msghandler", "ipmi_si"]
    # the two parts are the whole, nothing twice, each in load order
    assert sorted(network + others) == sorted(everything)
    assert everything == [m for m in LOAD_ORDER.split() if m in everything]


def test_without_a_part_the_output_is_unchanged(moddir: Path, tmp_path: Path) -> None:
    assert select(moddir, tmp_path / "b", VIRTIO_BLK, AHCI) == [
        "virtio_ring", "virtio", "virtio_pci", "failover", "net_failover", "virtio_net",
        "virtio_blk", "libata", "libahci", "ahci", "ipmi_msghandler", "ipmi_si",
    ]  # fmt: skip


def test_no_network_device_leaves_only_always_loaded_network_drivers(
    moddir: Path, tmp_path: Path
) -> None:
    """A machine whose only PCI devices are storage: virtio_pci (matched by the disk) is not
    network, virtio_net (always loaded, listed in network) is, with its own dependencies."""
    network = select(moddir, tmp_path / "c", VIRTIO_BLK, AHCI, part="network")
    assert network == ["virtio_ring", "virtio", "failover", "net_failover", "virtio_net"]
    others = select(moddir, tmp_path / "c", part="others")
    assert "virtio_pci" in others and "e1000" not in others
