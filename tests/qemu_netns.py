"""QEMU guests in a throwaway network namespace: a bridge with the test's server address and
tap devices for the guests, and processes started in it as their own process groups."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
