"""The network-cut variant's plumbing without Patroni (tests/fleet/netcut.py): the database
network's namespaces reach each other and the test process; a cut drops (not rejects) every
packet to and from the victim but loopback, or all but the allowed peers; its counters count
the drops; healing restores every path; closing deletes every namespace. The long run that
cuts a Patroni primary with it: tests/fleet/test_patroni_failover.py (``cut``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from ipaddress import IPv4Address
from pathlib import Path

import pytest

from netconfig import netns
from tests.fleet.netcut import DbNet, cut, cut_ruleset, dropped, heal

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(shutil.which("nft") is None, reason="nft (nftables) not installed"),
]
PORT = 5432

_SERVER = (
    "import socket\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    f"s.bind(('0.0.0.0', {PORT})); s.listen(64); print('up', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(b'hi'); c.close()\n"
)
_CLIENT = (
    "import socket, sys\n"
    "try:\n"
    "    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)\n"
    "    print(c.recv(2).decode() or 'closed')\n"
    "except TimeoutError:\n"
    "    print('timeout')\n"
    "except OSError as e:\n"
    "    print(type(e).__name__)\n"
)


def test_ruleset_drops_all_but_loopback_and_the_allowed_peers() -> None:
    full = cut_ruleset()
    assert 'iif "lo" accept' in full and 'oif "lo" accept' in full
    assert full.count("counter drop") == 2 and "saddr" not in full and "reject" not in full
    part = cut_ruleset(["10.0.0.12", IPv4Address("10.0.0.9"), "10.0.0.12"])
    assert "ip saddr { 10.0.0.9, 10.0.0.12 } accept" in part
    assert "ip daddr { 10.0.0.9, 10.0.0.12 } accept" in part
    with pytest.raises(ValueError):
        cut_ruleset(["not-an-address"])


@pytest.fixture
def net() -> Iterator[DbNet]:
    n = DbNet()
    try:
        n.add("a", 11)
        n.add("b", 12)
        yield n
    finally:
        n.close()


def _connect(net: DbNet, src: str | None, dst: str, dst_ip: str | None = None) -> str:
    """What a TCP connect from host ``src`` (None: the test process) to ``dst``'s server sees:
    ``hi`` (connected), ``timeout`` (dropped), or the error's name."""
    ip = dst_ip or str(net.ip(dst))
    argv = [sys.executable, "-c", _CLIENT, ip, str(PORT)]
    if src is not None:
        argv = netns.exec_argv(net.ns(src), argv)
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()


def test_cut_drops_everything_but_loopback_then_heals(net: DbNet) -> None:
    server = subprocess.Popen(
        netns.exec_argv(net.ns("b"), [sys.executable, "-c", _SERVER]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        assert _connect(net, "a", "b") == "hi"
        assert _connect(net, None, "b") == "hi"  # the test process's leg (ctl)

        cut(net.ns("b"))
        assert _connect(net, "a", "b") == "timeout"  # dropped: hangs, as on a real cut
        assert _connect(net, None, "b") == "timeout"
        assert _connect(net, "b", "b") == "hi"  # its own address: loopback still works
        assert _connect(net, "b", "b", "127.0.0.1") == "hi"
        counts = dropped(net.ns("b"))
        assert counts["input"] >= 2, counts  # the two SYNs (at least) from a and ctl

        heal(net.ns("b"))
        assert _connect(net, "a", "b") == "hi"
        assert _connect(net, None, "b") == "hi"

        # A partition: b keeps its link to a, loses everything else.
        cut(net.ns("b"), allow=[net.ip("a")])
        assert _connect(net, "a", "b") == "hi"
        assert _connect(net, None, "b") == "timeout"
        heal(net.ns("b"))
        assert _connect(net, None, "b") == "hi"
    finally:
        server.kill()
        server.wait()


def test_close_deletes_every_namespace_and_the_callers_leg() -> None:
    n = DbNet(tag="t" + str(int(time.monotonic()) % 1000))
    n.add("a", 11)
    names, leg = list(n.names), n.ctl_if
    assert all(netns.exists(x) for x in names) and len(names) == 2
    n.close()
    assert not any(netns.exists(x) for x in names)
    assert subprocess.run(["ip", "link", "show", leg], capture_output=True).returncode != 0
    routes = subprocess.run(["ip", "route", "show"], capture_output=True, text=True).stdout
    assert str(n.net) not in routes  # nothing of the /24 is left in the test's namespace


def test_patroni_lab_namespaces_are_deleted_when_its_caller_is_killed() -> None:
    """PatroniLab(netns=True) records each namespace before making it; kill -9 of the process
    that made them: the lab's watchdog deletes them all (and its folder). No etcd or Patroni
    is started: this is the cleanup the long test's lab relies on."""
    code = (
        "import time\n"
        "from tests.fleet.patroni_lab import PatroniLab\n"
        "lab = PatroniLab(netns=True)\n"
        "print(lab.root, *lab.net.names, flush=True); time.sleep(600)\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=root
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line, "the lab did not start"
        folder, names = Path(line[0]), line[1:]
        assert len(names) == 4 and all(netns.exists(n) for n in names)  # switch + 3 hosts
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 60
    while folder.exists() or any(netns.exists(n) for n in names):
        assert time.monotonic() < deadline, (folder.exists(), [n for n in names if netns.exists(n)])
        time.sleep(0.1)
