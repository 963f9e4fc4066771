"""The deploy agent's storage step as a pure function: the commands it would run for a claim's
storage layout (metald's own plan of a real layout against an inventory), checked exactly.

This host's kernel has no md module, so the commands are not run here; the QEMU lab test
(test_qemu_storage.py, METALD_LAB_LONG=1) runs them under Debian's kernel."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from metald.provision.storage import GIB, DiskInfo, plan
from tests.provision_agent.conftest import AGENT, BUSYBOX

pytestmark = pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed")

DISKS = [
    DiskInfo("vda", 20 * GIB, model="QEMU root", serial="r0"),
    DiskInfo("vdb", 20 * GIB, model="QEMU root", serial="r1"),
    DiskInfo("nvme0n1", 400 * GIB, model="Samsung PM9A3", serial="n0"),
    DiskInfo("nvme1n1", 400 * GIB, model="Samsung PM9A3", serial="n1"),
]


def commands(
    tmp_path: Path, busybox_bin: Path, storage: dict, what: str
) -> tuple[int, list[str], str]:
    (tmp_path / "provision.json").write_text(
        json.dumps({"action": "provision", "storage": storage})
    )
    script = (
        f'METALD_AGENT_LIB=1 . "{AGENT}"; jflat <"{tmp_path}/provision.json" >"{tmp_path}/p.flat"'
        f' && storage_commands {what} "{tmp_path}/p.flat"; rc=$?; echo "ERR $STORAGE_ERROR" >&2;'
        " exit $rc"
    )
    out = subprocess.run(
        [str(busybox_bin / "sh"), "-c", script],
        env={"PATH": str(busybox_bin), "METALD_STATE_DIR": str(tmp_path / "state")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.returncode, out.stdout.splitlines(), out.stderr


def test_raid1_root_and_lvm_on_raid0_scratch(tmp_path, busybox_bin):
    layout = {
        "root": {"raid": 1, "disks": [{"model": "QEMU"}, {"model": "QEMU"}]},
        "volumes": [
            {
                "name": "scratch",
                "raid": 0,
                "disks": "rest",
                "mount": "/scratch",
                "lvm": {"vg": "data", "lvs": [{"name": "scr", "size_gib": 500}, {"name": "tmp"}]},
            }
        ],
    }
    storage = plan(layout, DISKS).to_dict()
    rc, root, err = commands(tmp_path, busybox_bin, storage, "root")
    assert rc == 0, err
    assert root == [
        "wipefs -a /dev/vda",
        "wipefs -a /dev/vdb",
        "mdadm --create /dev/md0 --run --metadata=1.0 --level=1 --raid-devices=2 --name=root"
        " --homehost=any /dev/vda /dev/vdb",
    ]
    rc, vols, err = commands(tmp_path, busybox_bin, storage, "volumes")
    assert rc == 0, err
    assert vols == [
        "wipefs -a /dev/nvme0n1",
        "wipefs -a /dev/nvme1n1",
        "mdadm --create /dev/md1 --run --metadata=1.2 --level=0 --raid-devices=2 --name=scratch"
        " --homehost=any /dev/nvme0n1 /dev/nvme1n1",
        "lvm pvcreate -ff -y /dev/md1",
        "lvm vgcreate -y data /dev/md1",
        "lvm lvcreate -y -Wy -Zy -n scr -L 500g data",
        "mkfs.ext4 -F -q -L scr /dev/data/scr",
        "fstab LABEL=scr /scratch ext4",
        "lvm lvcreate -y -Wy -Zy -n tmp -l 100%FREE data",
        "mkfs.ext4 -F -q -L tmp /dev/data/tmp",
    ]
    # no --assume-clean anywhere: a mirror is resynced, never trusted to be equal
    assert not any("assume-clean" in c for c in root + vols)


def test_single_root_and_plain_raid1_scratch(tmp_path, busybox_bin):
    layout = {
        "root": {"hints": {"serial": "r1"}},
        "volumes": [
            {"name": "fast", "raid": 1, "disks": [{"serial": "n1"}, {"serial": "n0"}]},
            {"name": "spare", "disks": [{"serial": "r0"}], "mount": "/srv/spare", "fs": "xfs"},
        ],
    }
    storage = plan(layout, DISKS).to_dict()
    assert commands(tmp_path, busybox_bin, storage, "root")[:2] == (0, [])
    rc, vols, err = commands(tmp_path, busybox_bin, storage, "volumes")
    assert rc == 0, err
    assert vols == [
        "wipefs -a /dev/nvme1n1",
        "wipefs -a /dev/nvme0n1",
        "mdadm --create /dev/md1 --run --metadata=1.2 --level=1 --raid-devices=2 --name=fast"
        " --homehost=any /dev/nvme1n1 /dev/nvme0n1",
        "mkfs.ext4 -F -q -L fast /dev/md1",
        "wipefs -a /dev/vda",
        "mkfs.xfs -f -q -L spare /dev/vda",
        "fstab LABEL=spare /srv/spare xfs",
    ]


@pytest.mark.parametrize(
    ("storage", "why"),
    [
        # names from a hostile inventory never reach a command line
        ({"root": ["vda;reboot", "vdb"], "root_raid": 1, "volumes": []}, "disk name vda;reboot"),
        ({"root": ["vda", "vda"], "root_raid": 1, "volumes": []}, "names /dev/vda twice"),
        (
            {"root": ["vda"], "root_raid": None, "volumes": [
                {"name": "x", "raid": None, "devices": ["vdb"], "fs": "btrfs", "mount": None,
                 "lvm": None}]},
            "file system btrfs",
        ),
        (
            {"root": ["vda"], "root_raid": None, "volumes": [
                {"name": "x", "raid": None, "devices": ["vdb"], "fs": "ext4",
                 "mount": "/a b", "lvm": None}]},
            "mount point /a b",
        ),
        (
            {"root": ["vda"], "root_raid": None, "volumes": [
                {"name": "x", "raid": 0, "devices": ["vdb", "vdc"], "fs": "ext4", "mount": None,
                 "lvm": {"vg": "v$(id)", "lvs": [{"name": "a"}]}}]},
            "volume group name v$(id)",
        ),
        (
            {"root": ["vda"], "root_raid": None, "volumes": [
                {"name": "longer_than_12", "raid": None, "devices": ["vdb"], "fs": "xfs",
                 "mount": None, "lvm": None}]},
            "longer than xfs's 12 characters",
        ),
    ],
)  # fmt: skip
def test_refused_before_any_disk_is_touched(tmp_path, busybox_bin, storage, why):
    rc_root, root, err_root = commands(tmp_path, busybox_bin, storage, "root")
    rc_vols, vols, err_vols = commands(tmp_path, busybox_bin, storage, "volumes")
    assert 1 in (rc_root, rc_vols)
    assert why in err_root + err_vols


def test_the_os_keeps_its_mdadm_settings_and_gets_a_mailaddr(tmp_path, busybox_bin):
    """The arrays go into the deployed OS's /etc/mdadm/mdadm.conf beside what the image had
    (its HOMEHOST; an old ARRAY line is replaced); an image without MAILADDR or PROGRAM gets
    ``MAILADDR root``: without one Debian's mdmonitor.service fails and the OS boots
    degraded (seen in the Debian 12 lab boot). ``mdadm --detail --scan`` is a stand-in
    printing an ARRAY line (this host's kernel has no md); /proc/mdstat is a file."""
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    (sbin / "mdadm").write_text(
        "#!/bin/sh\necho 'ARRAY /dev/md0 metadata=1.0 name=any:root UUID=0a:0b:0c:0d'\n"
    )
    (sbin / "mdadm").chmod(0o755)
    mdstat = tmp_path / "mdstat"
    mdstat.write_text("Personalities : [raid1]\nmd0 : active raid1 vdb[1] vda[0]\n")
    root = tmp_path / "root"
    (root / "etc/mdadm").mkdir(parents=True)
    conf = root / "etc/mdadm/mdadm.conf"
    results = {}
    for case, before in {
        "debian": "HOMEHOST <system>\nMAILADDR ops@example.com\nARRAY /dev/md9 UUID=old\n",
        "bare": "HOMEHOST <system>\n",
    }.items():
        conf.write_text(before)
        (tmp_path / "state").mkdir(exist_ok=True)
        out = subprocess.run(
            [str(busybox_bin / "sh"), "-c", f'METALD_AGENT_LIB=1 . "{AGENT}"; storage_os_files "{root}"'],
            env={
                "PATH": str(busybox_bin),
                "METALD_STATE_DIR": str(tmp_path / "state"),
                "METALD_SBIN": str(sbin),
                "METALD_MDSTAT": str(mdstat),
            },
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        results[case] = conf.read_text().splitlines()
    array = "ARRAY /dev/md0 metadata=1.0 name=any:root UUID=0a:0b:0c:0d"
    assert results["debian"] == [
        "HOMEHOST <system>",
        "MAILADDR ops@example.com",
        "# arrays of the claim's storage layout (metald)",
        array,
    ]
    assert results["bare"] == [
        "HOMEHOST <system>",
        "MAILADDR root",
        "# arrays of the claim's storage layout (metald)",
        array,
    ]
