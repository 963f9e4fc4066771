"""Storage layouts against a machine's disks: Ironic-style root device hints, a RAID1 root,
RAID0/LVM scratch, and refusals that say why a layout does not fit."""

from __future__ import annotations

import re

import pytest

from metald.provision.storage import GIB, DiskInfo, LayoutError, disks_from_inventory, plan

DISKS = [
    DiskInfo(
        "sda",
        480 * GIB,
        "SAMSUNG MZ7L3480",
        "S6KN0001",
        "0x5002538f00000001",
        "/dev/disk/by-path/pci-0000:00:17.0-ata-1",
        False,
    ),
    DiskInfo(
        "sdb",
        480 * GIB,
        "SAMSUNG MZ7L3480",
        "S6KN0002",
        "0x5002538f00000002",
        "/dev/disk/by-path/pci-0000:00:17.0-ata-2",
        False,
    ),
    DiskInfo("nvme0n1", 3840 * GIB, "SAMSUNG MZQL23T8", "S64H0001", "eui.0001", None, False),
    DiskInfo("nvme1n1", 3840 * GIB, "SAMSUNG MZQL23T8", "S64H0002", "eui.0002", None, False),
    DiskInfo("sdc", 8000 * GIB, "ST8000NM", "ZA1", None, None, True),
]


def test_root_hints_like_ironic() -> None:
    assert plan({}, DISKS).root == ["sda"]  # the smallest disk, no hints
    assert plan({"root": {"hints": {"serial": "S6KN0002"}}}, DISKS).root == ["sdb"]
    assert plan({"root": {"hints": {"wwn": "5002538F00000002"}}}, DISKS).root == ["sdb"]
    assert plan({"root": {"hints": {"size": ">= 1000"}}}, DISKS).root == ["nvme0n1"]
    assert plan({"root": {"hints": {"size": 8000}}}, DISKS).root == ["sdc"]
    assert plan({"root": {"hints": {"model": "mzql23t8", "rotational": False}}}, DISKS).root == [
        "nvme0n1"
    ]
    hint = {"by_path": "/dev/disk/by-path/pci-0000:00:17.0-ata-2"}
    assert plan({"root": {"hints": hint}}, DISKS).root == ["sdb"]
    # the agent records udev's name without the folder (pci-...); either spelling matches
    assert plan({"root": {"hints": {"by_path": "pci-0000:00:17.0-ata-2"}}}, DISKS).root == ["sdb"]
    recorded = disks_from_inventory(
        {"disks": [{"name": "vda", "size_bytes": 10 * GIB, "by_path": "pci-0000:00:04.0"},
                   {"name": "vdb", "size_bytes": 10 * GIB, "by_path": "pci-0000:00:05.0"}]}
    )  # fmt: skip
    hint = {"by_path": "/dev/disk/by-path/pci-0000:00:05.0"}
    assert plan({"root": {"hints": hint}}, recorded).root == ["vdb"]
    assert plan({"root": {"hints": {"name": "/dev/nvme1n1"}}}, DISKS).root == ["nvme1n1"]


def test_raid1_root_raid0_scratch_lvm() -> None:
    p = plan(
        {
            "root": {"raid": 1, "disks": [{"model": "MZ7L3480"}, {"model": "MZ7L3480"}]},
            "volumes": [
                {
                    "name": "scratch",
                    "raid": 0,
                    "disks": [{"model": "MZQL23T8"}, {"model": "MZQL23T8"}],
                    "fs": "xfs",
                    "mount": "/scratch",
                    "lvm": {"vg": "data", "lvs": [{"name": "cache", "size_gib": 7000}]},
                },
                {"name": "bulk", "disks": "rest", "mount": "/bulk"},
            ],
        },
        DISKS,
    )
    assert p.root == ["sda", "sdb"] and p.root_raid == 1
    scratch, bulk = p.volumes
    assert scratch["devices"] == ["nvme0n1", "nvme1n1"] and scratch["size_bytes"] == 7680 * GIB
    assert bulk["devices"] == ["sdc"] and bulk["raid"] is None


@pytest.mark.parametrize(
    ("layout", "why"),
    [
        ({"root": {"hints": {"serial": "NOPE"}}}, "root: no disk matches {'serial': 'NOPE'}"),
        ({"root": {"raid": 1, "disks": [{"size": 3840}, {"size": 3840}, {}]}}, "exactly two"),
        (
            {"root": {"raid": 1, "disks": [{"size": 8000}, {"size": 8000}]}},
            "root RAID1 disk 1: no disk matches {'size': 8000} (sdc matched but is used already)",
        ),
        ({"root": {"raid": 0}}, "root raid must be 1"),
        (
            {"volumes": [{"name": "s", "raid": 0, "disks": [{"size": 8000}]}]},
            "volume s: RAID0 needs 2+ disks, 1 left (sdc)",
        ),
        (
            {
                "volumes": [
                    {
                        "name": "s",
                        "disks": [{"size": 8000}],
                        "lvm": {"vg": "d", "lvs": [{"name": "x", "size_gib": 9000}]},
                    }
                ]
            },
            "logical volumes ask 9000 GiB, the volume has 8000 GiB",
        ),
        ({"root": {"hints": {"colour": "red"}}}, "unknown root device hint 'colour'"),
        ({"root": {"hints": {"size": "about 5"}}}, "size hint 'about 5'"),
    ],
)
def test_a_layout_that_does_not_fit_says_why(layout: dict, why: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(LayoutError) as e:
        plan(layout, DISKS)
    assert why in str(e.value)


def test_inventory_disks_skip_removable() -> None:
    inv = {
        "disks": [
            {"name": "sda", "size_bytes": 1, "removable": True},
            {"name": "vda", "size_bytes": 2 * GIB},
        ]
    }
    assert [d.name for d in disks_from_inventory(inv)] == ["vda"]
    with pytest.raises(LayoutError, match="no disks"):
        plan({}, [])


@pytest.mark.parametrize(
    ("volume", "why"),
    [
        ({"name": "a b", "disks": [{"name": "sdc"}]}, "volume name 'a b'"),
        ({"name": "s", "disks": [{"name": "sdc"}], "mount": "/x/../etc"}, "mount point"),
        ({"name": "s", "disks": [{"name": "sdc"}], "mount": "/"}, "mount point '/'"),
        ({"name": "s", "disks": [{"name": "sdc"}], "mount": "/a;b"}, "mount point"),
        (
            {
                "name": "s",
                "disks": [{"name": "sdc"}],
                "lvm": {"vg": "v$(id)", "lvs": [{"name": "a"}]},
            },
            "volume group 'v$(id)'",
        ),
        ({"name": "s", "disks": [{"name": "sdc"}], "lvm": {"vg": "v", "lvs": []}}, "has no lvs"),
        ({"name": "thirteen_char", "disks": [{"name": "sdc"}], "fs": "xfs"}, "12 characters"),
    ],
)
def test_names_the_deploy_agent_would_refuse_are_refused_at_claim_time(volume, why):
    """The agent puts these on command lines and in the OS's fstab; a layout it would refuse
    at deploy fails the claim instead (fails on the old code, which took any name)."""
    disks = [DiskInfo("sda", 100 * GIB), DiskInfo("sdc", 100 * GIB)]
    with pytest.raises(LayoutError, match=re.escape(why)):
        plan({"volumes": [volume]}, disks)
