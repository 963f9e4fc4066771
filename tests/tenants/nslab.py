"""Test helpers: a hub namespace and a node namespace joined by a veth (the underlay)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from netconfig import netns


@dataclass
class Underlay:
    hub_ns: str
    node_ns: str
    hub_ip: str = "10.99.0.1"
    node_ip: str = "10.99.0.2"


@contextmanager
def underlay() -> Iterator[Underlay]:
    tag = secrets.token_hex(3)
    u = Underlay(f"mth-{tag}", f"mtn-{tag}")
    netns.create(u.hub_ns)
    try:
        netns.create(u.node_ns)
        netns.veth(u.hub_ns, "uh0", u.node_ns, "un0")
        netns.address(u.hub_ns, "uh0", f"{u.hub_ip}/24")
        netns.address(u.node_ns, "un0", f"{u.node_ip}/24")
        yield u
    finally:
        netns.delete(u.node_ns)
        netns.delete(u.hub_ns)


def in_ns(ns: str, *argv: str, **kw) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    return subprocess.run(netns.exec_argv(ns, argv), capture_output=True, text=True, **kw)


LISTENER = (
    "import socket,sys\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()\n"
    "while True:\n c,_=s.accept(); c.sendall(b'hub'); c.close()\n"
)
PROBE = (
    "import socket,sys\n"
    "c=socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)\n"
    "assert c.recv(3)==b'hub'\n"
)


@contextmanager
def tcp_listener(ns: str, addr: str, port: int) -> Iterator[None]:
    p = subprocess.Popen(
        netns.exec_argv(ns, [sys.executable, "-c", LISTENER, addr, str(port)]),
        stderr=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        p.kill()
        p.wait()


def tcp_reaches(ns: str, addr: str, port: int) -> bool:
    return in_ns(ns, sys.executable, "-c", PROBE, addr, str(port)).returncode == 0


def wait_for(cond: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def is_root() -> bool:
    return os.geteuid() == 0


CONNECT = (
    "import socket,sys\n"
    "socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()\n"
)


def tcp_connects(ns: str, addr: str, port: int) -> bool:
    """Whether a TCP connection from ``ns`` to addr:port is accepted (any server)."""
    return in_ns(ns, sys.executable, "-c", CONNECT, addr, str(port)).returncode == 0
