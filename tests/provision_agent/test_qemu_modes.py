"""Boot the built discovery image in QEMU (TCG) with metald.mode=wipe and metald.mode=deploy,
inside a network namespace this test creates (busybox udhcpd and the agent API stand-in
there), then read the disk files. Nothing leaves the namespace."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from metald.provision.metadata import nocloud
from metald.provision.wipe import evidence_problems, recorded_disks
from tests.provision_agent.conftest import MIB, ROOT, cloud_image, debugfs_cat
from tests.qemu_netns import QEMU_IN_NETNS, bridge_netns, metald_standin, run_guest, tap_nic

pytestmark = QEMU_IN_NETNS

SERVER = "10.78.0.1"
PORT = 8080
MAC = "52:54:00:6d:77:01"


@pytest.fixture
def netns() -> Iterator[str]:
    with bridge_netns(f"mdwipe{os.getpid()}", SERVER, ("tap0",)) as name:
        yield name


@pytest.fixture(scope="session")
def built_assets() -> Path:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("building boot assets needs apt-get and dpkg-deb (Debian)")
    from bootassets.build import ensure_built

    return ensure_built()


def boot(
    ns: str, tmp_path: Path, assets: Path, mode: str, drives: list[str], config: dict | None = None
) -> tuple[list[dict], str]:
    """Boot the discovery image in ``mode`` until it powers off or reboots (QEMU runs with
    -no-reboot, so both end it); the progress reports and the console log."""
    console = tmp_path / "console.log"
    server = ROOT / "tests/provision_agent/server.py"
    out = tmp_path / "progress.jsonl"
    with metald_standin(ns, tmp_path, server, SERVER, PORT, out, config) as reports:
        disc = assets / "discovery"
        qemu = [
            "qemu-system-x86_64", "-accel", "tcg", "-m", "384", "-smp", "2",
            "-kernel", str(disc / "vmlinuz"), "-initrd", str(disc / "initrd.img"),
            "-append", f"console=ttyS0 quiet no_timer_check metald.url=http://{SERVER}:{PORT} metald.token=agent-token metald.machine=lab-1 metald.mode={mode}",
            "-display", "none", "-monitor", "none", "-serial", f"file:{console}", "-no-reboot",
            *tap_nic(MAC),
            *drives,
        ]  # fmt: skip
        t0 = time.monotonic()
        rc, log = run_guest(ns, qemu, tmp_path, console, timeout=100)
        elapsed = time.monotonic() - t0
        assert rc == 0, (tmp_path / "qemu.log").read_text()
        print("\n" + "\n".join(line for line in log.splitlines() if "metald-agent:" in line))
        print(f"QEMU start to its end ({mode}): {elapsed:.1f} s")
    return [json.loads(line) for line in reports.read_text().splitlines()], log


def test_wipe_mode_erases_both_ends_of_every_disk(built_assets, netns, tmp_path):
    disks = {"vda.img": 64 * MIB, "vdb.img": 16 * MIB}
    middles = {}
    for name, size in disks.items():
        with open(tmp_path / name, "wb") as f:
            f.truncate(size)
            f.write(os.urandom(MIB))
            f.seek(size // 2)
            middles[name] = os.urandom(4096)
            f.write(middles[name])
            f.seek(size - MIB)
            f.write(os.urandom(MIB))
    drives = [
        # vda passes discards through (holes punched in the file); vdb has no discard at all
        "-drive", f"file={tmp_path / 'vda.img'},format=raw,if=none,id=d0,discard=unmap",
        "-device", "virtio-blk-pci,drive=d0",
        "-drive", f"file={tmp_path / 'vdb.img'},format=raw,if=none,id=d1",
        "-device", "virtio-blk-pci,drive=d1,discard=off",
    ]  # fmt: skip
    got, log = boot(netns, tmp_path, built_assets, "wipe", drives)
    assert "reboot: Power down" in log
    done = got[-1]
    assert {k: v for k, v in done.items() if k != "disks"} == {"phase": "wipe", "done": True}
    # The per-disk evidence of this real wipe is what metald accepts for a machine whose
    # inspection recorded these two disks; without it, or missing one, it is refused.
    recorded = recorded_disks(
        {"payload": {"disks": [{"name": "vda", "size_bytes": 64 * MIB},
                               {"name": "vdb", "size_bytes": 16 * MIB}]}}
    )  # fmt: skip
    assert evidence_problems(done["disks"], recorded) == [], done
    assert [d["method"] for d in done["disks"]] == ["discard+zero-ends", "zero-ends"]
    assert evidence_problems(done["disks"][:1], recorded) == [
        "/dev/vdb (16777216 bytes, recorded at inspection) was not wiped"
    ]
    assert [r.get("percent") for r in got[:-1]] == [50, 100]
    assert "wiped /dev/vda (67108864 bytes): discarded, zeroed first and last MiB, verified" in log
    assert "wiped /dev/vdb (16777216 bytes): zeroed first and last MiB, verified" in log
    for name, size in disks.items():
        data = (tmp_path / name).read_bytes()
        assert len(data) == size
        assert data[:MIB] == bytes(MIB), name
        assert data[-MIB:] == bytes(MIB), name
    # discard reached the file behind vda (its middle is gone); vdb, with none, keeps its
    # middle (the wipe promises the ends, partition tables and signatures, not every byte)
    assert (tmp_path / "vda.img").read_bytes()[32 * MIB : 32 * MIB + 4096] == bytes(4096)
    assert (tmp_path / "vdb.img").read_bytes()[8 * MIB : 8 * MIB + 4096] == middles["vdb.img"]


def test_deploy_mode_writes_verifies_seeds_and_reboots(built_assets, netns, tmp_path):
    image = cloud_image(tmp_path)
    (tmp_path / "image.raw").write_bytes(image)
    files = nocloud(
        machine_id="lab-1",
        name="lab-node-1",
        pxe_mac=MAC,
        ssh_authorized_keys=["ssh-ed25519 AAAA x"],
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
        },
    }
    disk = tmp_path / "vda.img"
    disk.write_bytes(os.urandom(16 * MIB))
    drives = ["-drive", f"file={disk},format=raw,if=virtio"]
    got, log = boot(netns, tmp_path, built_assets, "deploy", drives, config)
    assert "reboot: Restarting system" in log
    assert got[-1] == {"phase": "deploy", "done": True}, got
    writes = [r for r in got if r["phase"] == "write"]
    assert writes and writes[-1]["bytes"] == len(image) and writes[-1]["percent"] == 100
    assert "first-boot metadata written to /dev/vda1" in log
    data = disk.read_bytes()
    assert data[:MIB] == image[:MIB] and data[5 * MIB : 6 * MIB] == image[5 * MIB :]
    assert data[-MIB:] == bytes(MIB)
    for name in ("meta-data", "user-data", "network-config"):
        got_file = debugfs_cat(disk, MIB, 4 * MIB, f"/var/lib/cloud/seed/nocloud/{name}")
        assert got_file.decode() == files[name]
