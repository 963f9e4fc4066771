"""The agent's deploy and wipe modes run on the host under busybox sh, against a stand-in for
metald's agent API on 127.0.0.1, with loop devices as the disks."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from metald.provision.metadata import nocloud
from metald.provision.wipe import METHODS, evidence_problems, recorded_disks
from tests.provision_agent.conftest import (
    AGENT,
    MIB,
    cloud_image,
    debugfs_cat,
    needs_root_and_busybox,
    run_agent,
)
from tests.provision_agent.server import AgentApi

pytestmark = needs_root_and_busybox

SEED = "/var/lib/cloud/seed/nocloud"


def provision(port: int, image: bytes, *, path: str = "/image", **over: object) -> dict:
    files = nocloud(
        machine_id="m1",
        name="nœud-1",  # non-ASCII: json.dumps writes \u escapes the agent must decode
        pxe_mac="52:54:00:00:00:01",
        ssh_authorized_keys=['ssh-ed25519 AAAAC3Nz "quoted" comment\\with\\backslashes'],
        join={"url": "http://127.0.0.1:1", "token": "tok-123", "expires_at": "x"},
    )
    img = {
        "id": "img1",
        "kind": "disk",
        "url": f"http://127.0.0.1:{port}{path}",
        "sha256": hashlib.sha256(image).hexdigest(),
        "format": "raw",
        "size_bytes": len(image),
        **over,
    }
    return {"action": "provision", "machine_id": "m1", "image": img, "nocloud": files}


@pytest.mark.parametrize("compressed", [False, True], ids=["raw", "gzip"])
async def test_deploy_writes_verifies_and_seeds(
    tmp_path, busybox_bin, aiohttp_server, loops, compressed
):
    image = cloud_image(tmp_path)
    api = AgentApi(image=gzip.compress(image) if compressed else image)
    server = await aiohttp_server(api.app())
    api.provision = provision(server.port, image, path="/image.gz" if compressed else "/image")
    disk = tmp_path / "disk.img"
    disk.write_bytes(os.urandom(8 * MIB))  # old data everywhere, a larger disk than the image
    dev = loops.attach(disk)
    # the root partition as its own device: this kernel does not scan loop partitions
    part = loops.attach(disk, "-o", str(MIB), "--sizelimit", str(4 * MIB))

    rc, log = await run_agent(
        tmp_path,
        busybox_bin,
        server.port,
        "deploy",
        METALD_DISKS=dev,
        METALD_PARTITIONS=part,
        METALD_CHUNK_MB="1",
        METALD_PROGRESS_S="0",
    )
    assert rc == 0, log
    assert "dry run: would reboot" in log
    writes = [p for p in api.progress if p["phase"] == "write"]
    sizes = [p["bytes"] for p in writes]
    # one report per 1 MiB chunk, growing; the last one (the exact total) may repeat the 6th
    assert sizes == sorted(sizes) and len(set(sizes)) >= 6, api.progress
    assert sizes[-1] == len(image)
    assert writes[-1]["percent"] == 100
    assert all(p["rate_bps"] > 0 for p in writes)
    assert [p["phase"] for p in api.progress[-3:]] == ["verify", "verify", "deploy"]
    assert api.progress[-1] == {"phase": "deploy", "done": True}
    assert not any("error" in p for p in api.progress)

    loops.detach_all()
    data = disk.read_bytes()
    # outside the root file system (which now holds the seed) the disk is the image
    assert data[:MIB] == image[:MIB]
    assert data[5 * MIB : 6 * MIB] == image[5 * MIB :]
    # the old disk's last MiB (where a stale backup GPT would sit) is zeroed
    assert data[-MIB:] == bytes(MIB)
    for name in ("meta-data", "user-data", "network-config"):
        got = debugfs_cat(disk, MIB, 4 * MIB, f"{SEED}/{name}")
        assert got.decode() == api.provision["nocloud"][name]
    meta = json.loads(debugfs_cat(disk, MIB, 4 * MIB, f"{SEED}/meta-data"))
    assert meta["local-hostname"] == "nœud-1"


async def test_deploy_with_a_wrong_sha256_reports_an_error_and_stops(
    tmp_path, busybox_bin, aiohttp_server, loops
):
    image = cloud_image(tmp_path)
    api = AgentApi(image=image)
    server = await aiohttp_server(api.app())
    api.provision = provision(server.port, image, sha256="ab" * 32)
    disk = tmp_path / "disk.img"
    disk.write_bytes(bytes(8 * MIB))
    rc, log = await run_agent(
        tmp_path, busybox_bin, server.port, "deploy", METALD_DISKS=loops.attach(disk)
    )
    errors = [p for p in api.progress if "error" in p]
    assert len(errors) == 1, api.progress
    assert errors[0]["phase"] == "verify"
    assert "ab" * 32 in errors[0]["error"]
    assert hashlib.sha256(image).hexdigest() in errors[0]["error"]
    assert not any(p.get("done") for p in api.progress)
    # no reboot into a bad disk: the agent asks metald what next instead
    assert "would reboot" not in log
    assert api.next_calls >= 1


async def test_deploy_to_a_disk_that_refuses_writes_reports_an_error(
    tmp_path, busybox_bin, aiohttp_server, loops
):
    image = cloud_image(tmp_path)
    api = AgentApi(image=image)
    server = await aiohttp_server(api.app())
    api.provision = provision(server.port, image)
    disk = tmp_path / "disk.img"
    disk.write_bytes(bytes(8 * MIB))
    dev = loops.attach(disk, "-r")
    rc, log = await run_agent(tmp_path, busybox_bin, server.port, "deploy", METALD_DISKS=dev)
    errors = [p for p in api.progress if "error" in p]
    assert len(errors) == 1, (api.progress, log)
    assert dev in errors[0]["error"]
    assert not any(p.get("done") for p in api.progress)
    assert "would reboot" not in log


async def test_a_broken_download_is_reported(tmp_path, busybox_bin, aiohttp_server, loops):
    image = cloud_image(tmp_path)
    api = AgentApi(image=image, cut_after=3 * MIB)
    server = await aiohttp_server(api.app())
    api.provision = provision(server.port, image)
    disk = tmp_path / "disk.img"
    disk.write_bytes(bytes(8 * MIB))
    rc, log = await run_agent(
        tmp_path, busybox_bin, server.port, "deploy", METALD_DISKS=loops.attach(disk)
    )
    errors = [p for p in api.progress if "error" in p]
    assert len(errors) == 1, (api.progress, log)
    assert errors[0]["phase"] == "write"
    assert not any(p.get("done") for p in api.progress)


def _qcow2(tmp_path: Path, raw: bytes) -> bytes:
    src = tmp_path / "src.raw"
    src.write_bytes(raw)
    out = tmp_path / "image.qcow2"
    subprocess.run(
        ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", "-c", str(src), str(out)], check=True
    )
    return out.read_bytes()


@pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img (qemu-utils)")
async def test_deploy_qcow2_downloads_converts_compares_and_seeds(
    tmp_path, busybox_bin, aiohttp_server, loops
):
    """qcow2: downloaded, sha256 of the file checked, written by qemu-img (as the discovery
    image carries it), compared with the file over its virtual size, then seeded."""
    (busybox_bin / "qemu-img").symlink_to(shutil.which("qemu-img"))
    image = cloud_image(tmp_path)
    qcow = _qcow2(tmp_path, image)
    api = AgentApi(image=qcow)
    server = await aiohttp_server(api.app())
    api.provision = provision(server.port, qcow, format="qcow2")
    api.provision["image"]["sha256"] = hashlib.sha256(qcow).hexdigest()
    disk = tmp_path / "disk.img"
    disk.write_bytes(os.urandom(8 * MIB))  # a larger disk than the image, full of old data
    dev = loops.attach(disk)
    part = loops.attach(disk, "-o", str(MIB), "--sizelimit", str(4 * MIB))
    rc, log = await run_agent(
        tmp_path, busybox_bin, server.port, "deploy",
        METALD_DISKS=dev, METALD_PARTITIONS=part, METALD_PROGRESS_S="0",
        METALD_QCOW2_DIR=str(tmp_path),
    )  # fmt: skip
    assert rc == 0, log
    phases = [p["phase"] for p in api.progress]
    assert phases[0] == "download" and "write" in phases and phases[-1] == "deploy", api.progress
    assert api.progress[-1] == {"phase": "deploy", "done": True}
    assert not any("error" in p for p in api.progress)
    assert not (tmp_path / "image.qcow2").exists()  # the RAM copy is gone
    loops.detach_all()
    data = disk.read_bytes()
    assert data[:MIB] == image[:MIB] and data[5 * MIB : 6 * MIB] == image[5 * MIB :]
    assert data[-MIB:] == bytes(MIB)
    seeded = debugfs_cat(disk, MIB, 4 * MIB, f"{SEED}/meta-data")
    assert seeded.decode() == api.provision["nocloud"]["meta-data"]


@pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img (qemu-utils)")
async def test_deploy_qcow2_with_a_wrong_sha256_never_touches_the_disk(
    tmp_path, busybox_bin, aiohttp_server, loops
):
    (busybox_bin / "qemu-img").symlink_to(shutil.which("qemu-img"))
    qcow = _qcow2(tmp_path, cloud_image(tmp_path))
    api = AgentApi(image=qcow)
    server = await aiohttp_server(api.app())
    api.provision = provision(server.port, qcow, format="qcow2", sha256="cd" * 32)
    disk = tmp_path / "disk.img"
    old = os.urandom(8 * MIB)
    disk.write_bytes(old)
    rc, log = await run_agent(
        tmp_path, busybox_bin, server.port, "deploy", METALD_DISKS=loops.attach(disk),
        METALD_QCOW2_DIR=str(tmp_path),
    )  # fmt: skip
    errors = [p for p in api.progress if "error" in p]
    assert len(errors) == 1 and errors[0]["phase"] == "verify", (api.progress, log)
    assert "cd" * 32 in errors[0]["error"]
    loops.detach_all()
    data = disk.read_bytes()
    # only the ends were zeroed (before the download); the image was never written
    assert data[MIB:-MIB] == old[MIB:-MIB]


async def test_an_image_without_a_seed_place_is_reported(
    tmp_path, busybox_bin, aiohttp_server, loops
):
    image = os.urandom(2 * MIB)  # no partition table, no file system
    api = AgentApi(image=image)
    server = await aiohttp_server(api.app())
    api.provision = provision(server.port, image)
    disk = tmp_path / "disk.img"
    disk.write_bytes(bytes(4 * MIB))
    rc, log = await run_agent(
        tmp_path, busybox_bin, server.port, "deploy", METALD_DISKS=loops.attach(disk)
    )
    phases = [p["phase"] for p in api.progress]
    assert "verify" in phases  # the image itself was written and verified
    assert api.progress[-1]["phase"] == "metadata"
    assert "cidata" in api.progress[-1]["error"]


async def test_wipe_zeroes_and_verifies_the_ends_of_every_disk(
    tmp_path, busybox_bin, aiohttp_server, loops
):
    api = AgentApi()
    server = await aiohttp_server(api.app())
    files = [tmp_path / "a.img", tmp_path / "b.img"]
    files[0].write_bytes(os.urandom(8 * MIB))
    files[1].write_bytes(os.urandom(3 * MIB + 512))  # not a whole number of MiB
    devs = [loops.attach(f) for f in files]
    rc, log = await run_agent(
        tmp_path, busybox_bin, server.port, "wipe", METALD_DISKS=" ".join(devs)
    )
    assert rc == 0, log
    assert "dry run: would poweroff" in log
    assert [p.get("percent") for p in api.progress[:2]] == [50, 100]
    done = api.progress[-1]
    assert {k: v for k, v in done.items() if k != "disks"} == {"phase": "wipe", "done": True}
    # The evidence names each disk, its size, the method and both verification reads, and
    # metald accepts it for a machine whose inspection recorded these disks.
    sizes = [8 * MIB, 3 * MIB + 512]
    assert [(d["device"], d["size_bytes"]) for d in done["disks"]] == list(
        zip(devs, sizes, strict=True)
    )
    assert done["disks"][1]["reads"] == [
        {"offset": 0, "length": MIB, "zero": True},
        {"offset": 2 * MIB + 512, "length": MIB, "zero": True},
    ]
    assert {d["method"] for d in done["disks"]} <= METHODS
    # (Loop devices are never in an inventory: the same evidence under the names of a
    # machine's disks.)
    named = [{**d, "device": f"/dev/vd{c}"} for d, c in zip(done["disks"], "ab", strict=True)]
    recorded = recorded_disks(
        {
            "payload": {
                "disks": [
                    {"name": f"vd{c}", "size_bytes": n} for c, n in zip("ab", sizes, strict=True)
                ]
            }
        }
    )
    assert evidence_problems(named, recorded) == []
    loops.detach_all()
    for f in files:
        data = f.read_bytes()
        assert data[:MIB] == bytes(MIB), f
        assert data[-MIB:] == bytes(MIB), f


async def test_a_failed_wipe_is_reported_and_never_done(
    tmp_path, busybox_bin, aiohttp_server, loops
):
    api = AgentApi()
    server = await aiohttp_server(api.app())
    disk = tmp_path / "a.img"
    disk.write_bytes(os.urandom(4 * MIB))
    dev = loops.attach(disk, "-r")
    rc, log = await run_agent(tmp_path, busybox_bin, server.port, "wipe", METALD_DISKS=dev)
    assert len(api.progress) == 1, (api.progress, log)
    assert api.progress[0]["phase"] == "wipe" and dev in api.progress[0]["error"]
    # a machine that could not be wiped is still powered off (metald holds it in wipe-failed)
    assert "dry run: would poweroff" in log


async def test_wipe_with_no_disks_is_a_failure(tmp_path, busybox_bin, aiohttp_server):
    api = AgentApi()
    server = await aiohttp_server(api.app())
    (tmp_path / "sysroot" / "sys" / "block").mkdir(parents=True)
    rc, log = await run_agent(tmp_path, busybox_bin, server.port, "wipe")
    assert len(api.progress) == 1, (api.progress, log)
    assert "no disks found" in api.progress[0]["error"]


def test_disks_are_the_fixed_ones_in_sys_block(tmp_path, busybox_bin):
    block = tmp_path / "sys" / "block"
    for name, size, removable in (
        ("nvme0n1", "7814037168", "0"),
        ("sda", "3750748848", "0"),
        ("sdb", "62914560", "1"),  # a USB stick
        ("loop0", "2048", "0"),
        ("sr0", "2097152", "1"),
        ("nvme1n1", "0", "0"),  # no medium / size
    ):
        (block / name).mkdir(parents=True)
        (block / name / "size").write_text(size + "\n")
        (block / name / "removable").write_text(removable + "\n")
    script = f'METALD_AGENT_LIB=1 . "{AGENT}"; list_disks'
    out = subprocess.run(
        [str(busybox_bin / "sh"), "-c", script],
        env={"PATH": str(busybox_bin), "METALD_SYSROOT": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["/dev/nvme0n1", "/dev/sda"]


@pytest.mark.parametrize(
    ("dirty_at", "clean"),
    [(None, True), (0, False), (-1, False), (-(1 << 20), False), (-(1 << 20) - 1, True)],
    ids=["zero", "first-byte", "last-byte", "last-MiB-start", "just-before-last-MiB"],
)
def test_wipe_verification_reads_both_ends(tmp_path, busybox_bin, dirty_at, clean) -> None:  # type: ignore[no-untyped-def]
    """ends_zero checks exactly the first and the last MiB (the last one is reached with dd's
    seek; busybox cmp's skip argument read the whole disk to get there)."""
    disk = tmp_path / "disk.img"
    size = 4 << 30
    with open(disk, "wb") as f:
        f.truncate(size)
        if dirty_at is not None:
            f.seek(dirty_at % size)
            f.write(b"x")
    script = f'METALD_AGENT_LIB=1 . "{AGENT}"; ends_zero "{disk}" {size}'
    out = subprocess.run(
        [str(busybox_bin / "sh"), "-c", script],
        env={"PATH": str(busybox_bin)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (out.returncode == 0) is clean, out.stderr


async def test_deploy_to_the_layouts_root_disk_with_vendor_data(
    tmp_path, busybox_bin, aiohttp_server, loops
):
    """The storage plan's root disk is the target (not the first disk), and a tenant's
    user-data is seeded byte for byte with metald's vendor-data beside it."""
    image = cloud_image(tmp_path)
    api = AgentApi(image=image)
    server = await aiohttp_server(api.app())
    ud = "#!/bin/sh\necho tenant > /root/t\n"
    files = nocloud(
        machine_id="m1",
        name="n1",
        pxe_mac=None,
        ssh_authorized_keys=[],
        join={"url": "http://127.0.0.1:1", "token": "tok-9", "expires_at": "x"},
        user_data=ud,
    )
    first, second = tmp_path / "a.img", tmp_path / "b.img"
    first.write_bytes(bytes(8 * MIB))
    second.write_bytes(os.urandom(8 * MIB))
    dev_a, dev_b = loops.attach(first), loops.attach(second)
    part = loops.attach(second, "-o", str(MIB), "--sizelimit", str(4 * MIB))
    api.provision = {
        **provision(server.port, image),
        "nocloud": files,
        "storage": {"root": [Path(dev_b).name], "root_raid": None, "volumes": []},
    }
    rc, log = await run_agent(
        tmp_path,
        busybox_bin,
        server.port,
        "deploy",
        METALD_DISKS=f"{dev_a} {dev_b}",
        METALD_PARTITIONS=part,
        METALD_PROGRESS_S="0",
    )
    assert rc == 0, log
    assert api.progress[-1] == {"phase": "deploy", "done": True}
    loops.detach_all()
    assert first.read_bytes() == bytes(8 * MIB)  # the first disk is untouched
    assert second.read_bytes()[:MIB] == image[:MIB]
    assert debugfs_cat(second, MIB, 4 * MIB, f"{SEED}/user-data").decode() == ud
    vendor = debugfs_cat(second, MIB, 4 * MIB, f"{SEED}/vendor-data").decode()
    assert vendor == files["vendor-data"] and "tok-9" in vendor

    # A plan naming disks this machine does not have (another machine's, a stale inventory) is
    # refused before any disk is touched: wipefs and mdadm never see them.
    api.progress.clear()
    api.provision["storage"] = {"root": ["sda", "sdb"], "root_raid": 1, "volumes": []}
    dev_a = loops.attach(first)
    rc, log = await run_agent(tmp_path, busybox_bin, server.port, "deploy", METALD_DISKS=dev_a)
    errors = [p.get("error") or "" for p in api.progress]
    assert any("/dev/sda is not one of this machine's disks" in e for e in errors), api.progress
    loops.detach_all()
    assert first.read_bytes() == bytes(8 * MIB)
