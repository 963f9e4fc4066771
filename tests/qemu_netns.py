"""QEMU guests in a throwaway network namespace: a bridge with the test's server address and
tap devices for the guests, processes started in it as their own process groups, and the one
harness the QEMU tests share: busybox udhcpd and a stand-in for metald's endpoints on the
bridge (``metald_standin``), and a guest NIC on a tap (``tap_nic``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from vmlab import procs

#: Marks for a module of QEMU guests in a namespace (the lab suite, root, QEMU and busybox).
QEMU_IN_NETNS = [
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


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def bridge_netns(name: str, server: str, taps: tuple[str, ...] = ("tap0",)) -> Iterator[str]:
    """Namespace ``name`` with bridge br0 at ``server``/24 and ``taps`` on it; deleted after."""
    ip("netns", "add", name)
    try:
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "link", "add", "br0", "type", "bridge", "forward_delay", "0")
        ip("-n", name, "addr", "add", f"{server}/24", "dev", "br0")
        for tap in taps:
            ip("-n", name, "tuntap", "add", "dev", tap, "mode", "tap")
            ip("-n", name, "link", "set", tap, "master", "br0", "up")
        ip("-n", name, "link", "set", "br0", "up")
        yield name
    finally:
        ip("netns", "del", name)


def start(ns: str, args: list[str], log: Path, **kw: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        **kw,  # type: ignore[arg-type]
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    procs.stop_group(proc)


#: How long a stand-in may take to listen.
STANDIN_START_S = 20


def udhcpd_config(tmp_path: Path, server: str) -> Path:
    """busybox udhcpd on br0 leasing .100-.150 of the server's /24 (no router, no DNS)."""
    net = server.rsplit(".", 1)[0]
    conf = tmp_path / "udhcpd.conf"
    conf.write_text(
        f"start {net}.100\nend {net}.150\ninterface br0\nmax_leases 50\n"
        f"lease_file {tmp_path / 'leases'}\npidfile {tmp_path / 'udhcpd.pid'}\n"
        "option subnet 255.255.255.0\n"
    )
    (tmp_path / "leases").touch()
    return conf


@contextmanager
def metald_standin(
    ns: str,
    tmp_path: Path,
    script: Path,
    server: str,
    port: int,
    out: Path,
    config: dict[str, Any] | None = None,
) -> Iterator[Path]:
    """busybox udhcpd and a stand-in for metald's endpoints on namespace ``ns``'s bridge,
    until the block ends. ``script`` is run as ``python SCRIPT HOST PORT OUTFILE READYFILE
    [CONFIG.json]`` (the stand-ins of tests/inventory, tests/provision_agent and
    tests/bootassets all take these): it records what the guest sends to ``out`` and creates
    READYFILE once it listens. Yields ``out``."""
    ready = tmp_path / "ready"
    server_cmd = [sys.executable, str(script), server, str(port), str(out), str(ready)]
    if config is not None:
        (tmp_path / "standin.json").write_text(json.dumps(config))
        server_cmd.append(str(tmp_path / "standin.json"))
    log = tmp_path / "standin.log"
    started = [
        start(
            ns,
            ["busybox", "udhcpd", "-f", str(udhcpd_config(tmp_path, server))],
            tmp_path / "udhcpd.log",
        ),
        start(ns, server_cmd, log),
    ]
    try:
        deadline = time.monotonic() + STANDIN_START_S
        while not ready.exists():
            assert started[1].poll() is None, f"the stand-in exited: {log.read_text()}"
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield out
    finally:
        for p in started:
            stop(p)


def tap_nic(mac: str, tap: str = "tap0", model: str = "virtio-net-pci") -> list[str]:
    """QEMU arguments for a guest NIC on ``tap`` (made by ``bridge_netns``)."""
    nid = f"n{tap.removeprefix('tap')}"
    return [
        "-netdev", f"tap,id={nid},ifname={tap},script=no,downscript=no",
        "-device", f"{model},netdev={nid},mac={mac}",
    ]  # fmt: skip


def run_guest(
    ns: str, qemu: list[str], tmp_path: Path, console: Path, *, timeout: float
) -> tuple[int, str]:
    """Run QEMU in ``ns`` until it ends by itself (the guest powers off, or reboots under
    -no-reboot); its exit status and the console log. Fails the test with the console if the
    guest is still up after ``timeout`` seconds."""
    vm = start(ns, qemu, tmp_path / "qemu.log")
    try:
        rc = vm.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the VM did not stop; console:\n{console.read_text(errors='replace')}")
    finally:
        stop(vm)
    return rc, console.read_text(errors="replace")
