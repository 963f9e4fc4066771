"""Boot the built discovery image in QEMU (TCG) with metald.mode=wipe, inside a network
namespace this test creates (busybox udhcpd and the agent API stand-in there), against two
virtio disks whose first and last MiB hold random data. Nothing leaves the namespace."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.provision_agent.conftest import MIB, ROOT

pytestmark = [
    pytest.mark.lab,
    pytest.mark.root,
    pytest.mark.skipif(
        os.geteuid() != 0, reason="needs root for network namespaces and tap devices"
    ),
    pytest.mark.skipif(
        shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 is not installed"
    ),
    pytest.mark.skipif(shutil.which("busybox") is None, reason="busybox is not installed (udhcpd)"),
]

SERVER = "10.78.0.1"
PORT = 8080
MAC = "52:54:00:6d:77:01"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"mdwipe{os.getpid()}"
    ip("netns", "add", name)
    try:
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "link", "add", "br0", "type", "bridge", "forward_delay", "0")
        ip("-n", name, "addr", "add", f"{SERVER}/24", "dev", "br0")
        ip("-n", name, "tuntap", "add", "dev", "tap0", "mode", "tap")
        ip("-n", name, "link", "set", "tap0", "master", "br0", "up")
        ip("-n", name, "link", "set", "br0", "up")
        yield name
    finally:
        ip("netns", "del", name)


@pytest.fixture(scope="session")
def built_assets() -> Path:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("building boot assets needs apt-get and dpkg-deb (Debian)")
    from bootassets.build import ensure_built

    return ensure_built()


def start(ns: str, args: list[str], log: Path, **kw: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        **kw,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_wipe_mode_erases_both_ends_of_every_disk(built_assets, netns, tmp_path):
    conf = tmp_path / "udhcpd.conf"
    conf.write_text(
        f"start 10.78.0.100\nend 10.78.0.150\ninterface br0\nmax_leases 50\n"
        f"lease_file {tmp_path / 'leases'}\npidfile {tmp_path / 'udhcpd.pid'}\n"
        "option subnet 255.255.255.0\n"
    )
    (tmp_path / "leases").touch()
    reports, ready = tmp_path / "progress.jsonl", tmp_path / "ready"
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
    console = tmp_path / "console.log"
    procs = [
        start(netns, ["busybox", "udhcpd", "-f", str(conf)], tmp_path / "udhcpd.log"),
        start(
            netns,
            [
                sys.executable,
                str(ROOT / "tests/provision_agent/server.py"),
                SERVER,
                str(PORT),
                str(reports),
                str(ready),
            ],
            tmp_path / "server.log",
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        ),
    ]
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.1)
        disc = built_assets / "discovery"
        qemu = [
            "qemu-system-x86_64", "-accel", "tcg", "-m", "384", "-smp", "2",
            "-kernel", str(disc / "vmlinuz"), "-initrd", str(disc / "initrd.img"),
            "-append", f"console=ttyS0 quiet metald.url=http://{SERVER}:{PORT} metald.token=agent-token metald.machine=lab-1 metald.mode=wipe",
            "-display", "none", "-monitor", "none", "-serial", f"file:{console}", "-no-reboot",
            "-netdev", "tap,id=n0,ifname=tap0,script=no,downscript=no", "-device", f"virtio-net-pci,netdev=n0,mac={MAC}",
            # vda passes discards through (holes punched in the file); vdb has no discard at all
            "-drive", f"file={tmp_path / 'vda.img'},format=raw,if=none,id=d0,discard=unmap",
            "-device", "virtio-blk-pci,drive=d0",
            "-drive", f"file={tmp_path / 'vdb.img'},format=raw,if=none,id=d1",
            "-device", "virtio-blk-pci,drive=d1,discard=off",
        ]  # fmt: skip
        t0 = time.monotonic()
        vm = start(netns, qemu, tmp_path / "qemu.log")
        procs.append(vm)
        try:
            rc = vm.wait(timeout=100)  # the agent powers the machine off when done
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the VM did not power off; console:\n{console.read_text(errors='replace')}"
            )
        elapsed = time.monotonic() - t0
        log = console.read_text(errors="replace")
        assert rc == 0, (tmp_path / "qemu.log").read_text()
        print("\n" + "\n".join(line for line in log.splitlines() if "metald-agent:" in line))
        print(f"QEMU start to power off: {elapsed:.1f} s")
    finally:
        for p in procs:
            stop(p)

    got = [json.loads(line) for line in reports.read_text().splitlines()]
    assert got[-1] == {"phase": "wipe", "done": True}, got
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
