"""Boot the built discovery image in QEMU (TCG) on a bridge inside a network namespace this
test creates, with busybox udhcpd and a receiver there, and check the posted inventory against
the QEMU configuration. Nothing leaves the namespace."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest

from metald.inventory import normalize, parse_payload
from tests.inventory.conftest import ROOT
from tests.qemu_netns import QEMU_IN_NETNS, bridge_netns, metald_standin, run_guest, tap_nic

pytestmark = QEMU_IN_NETNS

SERVER = "10.77.0.1"
PORT = 8080
MAC = "52:54:00:6d:64:01"
MAC2 = "52:54:00:6d:64:02"
SYSTEM_UUID = "6d657461-6c64-4000-8000-000000000001"
VDA_BYTES = 1 << 30
NVME_BYTES = 256 << 20


@pytest.fixture
def netns() -> Iterator[str]:
    with bridge_netns(f"mdinv{os.getpid()}", SERVER, ("tap0", "tap1")) as name:
        yield name


def test_discovery_image_posts_what_qemu_has(built_assets, netns, tmp_path):
    for name, size in (("vda.img", VDA_BYTES), ("nvme.img", NVME_BYTES)):
        with open(tmp_path / name, "wb") as f:
            f.truncate(size)
    console = tmp_path / "console.log"
    receiver = ROOT / "tests/inventory/receiver.py"
    with metald_standin(netns, tmp_path, receiver, SERVER, PORT, tmp_path / "posts.jsonl") as posts:
        disc = built_assets / "discovery"
        qemu = [
            "qemu-system-x86_64", "-accel", "tcg", "-m", "512", "-smp", "2",
            "-kernel", str(disc / "vmlinuz"), "-initrd", str(disc / "initrd.img"),
            "-append", f"console=ttyS0 quiet no_timer_check metald.url=http://{SERVER}:{PORT} metald.token=agent-token metald.machine=lab-1",
            "-display", "none", "-monitor", "none", "-serial", f"file:{console}", "-no-reboot",
            "-smbios", f"type=1,manufacturer=metald-lab,product=discovery-vm,serial=LAB-0001,uuid={SYSTEM_UUID}",
            *tap_nic(MAC, "tap0"), *tap_nic(MAC2, "tap1", "e1000"),
            "-drive", f"file={tmp_path / 'vda.img'},format=raw,if=virtio",
            "-drive", f"file={tmp_path / 'nvme.img'},format=raw,if=none,id=nv0", "-device", "nvme,drive=nv0,serial=NVME-LAB-1",
            # QEMU's own BMC simulator on a KCS interface: ipmitool in the image talks to it
            "-device", "ipmi-bmc-sim,id=bmc0", "-device", "isa-ipmi-kcs,bmc=bmc0",
        ]  # fmt: skip
        t0 = time.time()
        # the agent is told to power off: QEMU exits by itself
        rc, log = run_guest(netns, qemu, tmp_path, console, timeout=150)
        assert rc == 0, (tmp_path / "qemu.log").read_text()
        assert "] inventory posted (" in log, log
        assert "] next action: poweroff" in log, log
        drivers = next(line for line in log.splitlines() if "drivers loaded:" in line).split()
        # matched to the devices QEMU has: virtio, e1000, NVMe, the BMC's KCS; no server NICs
        assert {"virtio_net", "virtio_pci", "e1000", "nvme", "ipmi_si"} <= set(drivers)
        assert not {"mlx5_core", "ice", "igb", "ahci"} & set(drivers)
        print("\n" + "\n".join(line for line in log.splitlines() if "metald-agent:" in line))

    records = [json.loads(line) for line in posts.read_text().splitlines()]
    assert len(records) == 1
    print(
        f"\nboot to inventory post: {records[0]['at'] - t0:.1f} s (QEMU TCG start to POST received)"
    )
    payload = parse_payload(records[0]["body"])
    assert payload.machine_id == "lab-1" and payload.sequence == 1
    inv = normalize(payload)
    assert (inv.vendor, inv.product, inv.serial, inv.system_uuid) == (
        "metald-lab",
        "discovery-vm",
        "LAB-0001",
        SYSTEM_UUID,
    )
    assert inv.cpu_count == 2
    assert inv.memory_mb == 512
    nics = {n.mac: n for n in inv.nics}
    assert set(nics) == {MAC, MAC2}
    assert (nics[MAC].driver, nics[MAC].link) == ("virtio_net", True)
    assert nics[MAC2].driver == "e1000"
    disks = {d.name: d for d in inv.disks}
    assert disks["vda"].size_bytes == VDA_BYTES
    assert (disks["nvme0n1"].size_bytes, disks["nvme0n1"].serial) == (NVME_BYTES, "NVME-LAB-1")
    assert inv.gpu_count == 0
    assert any(d.vendor == "0x1af4" for d in payload.pci)  # virtio devices seen on the PCI bus
