"""A claim's storage layout built by the real discovery image under Debian's kernel (which has
md and dm, unlike this host's): QEMU (TCG) with four virtio disks gets a RAID1 root over vda
and vdb (the image written onto the array, its seed on md0p1 with /etc/fstab and mdadm.conf)
and LVM on a RAID0 of vdc and vdd for scratch; /proc/mdstat is read from inside the guest (the agent logs it on the
console). Then a wipe boot of the same disks leaves no md superblock and no LVM label on any.

METALD_LAB_LONG=1 only (make test-long): two TCG boots, about 1-2 minutes."""

from __future__ import annotations

import hashlib
import os

import pytest

from metald.provision.metadata import nocloud
from metald.provision.storage import DiskInfo, plan
from tests.provision_agent.conftest import MIB, cloud_image, debugfs_cat
from tests.provision_agent.test_qemu_modes import (  # noqa: F401 (fixtures)
    MAC,
    PORT,
    SERVER,
    boot,
    built_assets,
    netns,
)
from tests.qemu_netns import QEMU_IN_NETNS

pytestmark = [
    *QEMU_IN_NETNS,
    pytest.mark.skipif(
        os.environ.get("METALD_LAB_LONG") != "1",
        reason="two TCG boots building arrays: set METALD_LAB_LONG=1 (make test-long)",
    ),
]

MD_MAGIC = (0xA92B4EFC).to_bytes(4, "little")
SIZES = {"vda": 32 * MIB, "vdb": 32 * MIB, "vdc": 48 * MIB, "vdd": 48 * MIB}


def md_superblocks(data: bytes) -> list[int]:
    """Offsets of an md superblock magic where versions 0.90, 1.0, 1.1 and 1.2 keep it."""
    size = len(data)
    places = {0, 4096, ((size >> 9) - 16 & ~7) << 9, ((size >> 16) - 1 << 16)}
    return sorted(p for p in places if data[p : p + 4] == MD_MAGIC)


def test_raid1_root_and_lvm_scratch_then_wipe(built_assets, netns, tmp_path):  # noqa: F811
    image = cloud_image(tmp_path)
    (tmp_path / "image.raw").write_bytes(image)
    disks = [DiskInfo(n, s, model="QEMU HARDDISK", serial=n) for n, s in SIZES.items()]
    layout = {
        "root": {"raid": 1, "disks": [{"serial": "vda"}, {"serial": "vdb"}]},
        "volumes": [
            {
                "name": "scratch",
                "raid": 0,
                "disks": "rest",
                "mount": "/scratch",
                "lvm": {"vg": "data", "lvs": [{"name": "scr"}]},
            }
        ],
    }
    storage = plan(layout, disks).to_dict()
    assert storage["root"] == ["vda", "vdb"] and storage["root_raid"] == 1
    files = nocloud(
        machine_id="lab-1", name="lab-node-1", pxe_mac=MAC, ssh_authorized_keys=["ssh-ed25519 A"]
    )
    config = {
        "image_file": str(tmp_path / "image.raw"),
        "provision": {
            "action": "provision",
            "machine_id": "lab-1",
            "image": {
                "id": "img1",
                "kind": "disk",
                "url": f"http://{SERVER}:{PORT}/image",
                "sha256": hashlib.sha256(image).hexdigest(),
                "format": "raw",
                "size_bytes": len(image),
            },
            "nocloud": files,
            "storage": storage,
        },
    }
    drives = []
    for i, (name, size) in enumerate(SIZES.items()):
        (tmp_path / f"{name}.img").write_bytes(os.urandom(size))
        drives += ["-drive", f"file={tmp_path / name}.img,format=raw,if=none,id=d{i}"]
        drives += ["-device", f"virtio-blk-pci,drive=d{i},serial={name}"]
    got, log = boot(netns, tmp_path, built_assets, "deploy", drives, config)
    assert got[-1] == {"phase": "deploy", "done": True}, (got, log[-3000:])
    assert "reboot: Restarting system" in log
    # /proc/mdstat from inside the guest: the mirror over both disks
    (arrays,) = [
        line for line in log.splitlines() if "metald-agent:" in line and "] arrays: " in line
    ]
    assert "md0 : active raid1" in arrays and "vda[0]" in arrays and "vdb[1]" in arrays, arrays
    assert "first-boot metadata written to /dev/md0p1" in log
    # metadata 1.0: the array's data starts at sector 0 of each member, as the firmware reads
    # it, and the superblock sits at the end; both members hold the same root (a mirror)
    a, b = ((tmp_path / f"{n}.img").read_bytes() for n in ("vda", "vdb"))
    assert a[:MIB] == image[:MIB] and b[:MIB] == image[:MIB]
    assert a[MIB : 5 * MIB] == b[MIB : 5 * MIB]
    assert md_superblocks(a) == md_superblocks(b) == [((32 * MIB >> 9) - 16 & ~7) << 9]
    vda = tmp_path / "vda.img"
    fstab = debugfs_cat(vda, MIB, 4 * MIB, "/etc/fstab").decode()
    assert "LABEL=scr /scratch ext4 defaults,nofail 0 2" in fstab, fstab
    mdconf = debugfs_cat(vda, MIB, 4 * MIB, "/etc/mdadm/mdadm.conf").decode()
    assert "ARRAY /dev/md0" in mdconf and "name=" in mdconf, mdconf
    assert (
        debugfs_cat(vda, MIB, 4 * MIB, "/var/lib/cloud/seed/nocloud/meta-data").decode()
        == (files["meta-data"])
    )
    # the RAID0 (metadata 1.2: superblock 4 KiB in, data after an offset) holds the LVM PV:
    # its label sits past the first MiB of vdc, where zeroing a disk's ends does not reach
    assert "md1 : active raid0" in arrays, arrays
    vdc = (tmp_path / "vdc.img").read_bytes()
    assert md_superblocks(vdc) == [4096]
    label = vdc.find(b"LABELONE", 0, 16 * MIB)
    assert label >= MIB, label

    # release: the wipe boot clears the array and the volume group from every disk
    for p in ("progress.jsonl", "console.log"):
        (tmp_path / p).unlink(missing_ok=True)
    got, log = boot(netns, tmp_path, built_assets, "wipe", drives)
    assert got[-1].get("done") is True, (got, log[-3000:])
    assert len(got[-1]["disks"]) == 4
    for name in SIZES:
        data = (tmp_path / f"{name}.img").read_bytes()
        assert md_superblocks(data) == [], name
        assert b"LABELONE" not in data[: 16 * MIB], name
        assert data[:MIB] == bytes(MIB) and data[-MIB:] == bytes(MIB), name
