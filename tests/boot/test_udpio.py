"""Batched UDP sends (metald.boot.udpio): every datagram arrives intact, a datagram the
kernel refuses is reported with its tag and the rest still go, a full send buffer (EAGAIN)
reports the rest of the batch; the sendmmsg path and the per-datagram path agree."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from metald.boot import udpio
from metald.boot.udpio import SendBatch

ROOT = os.geteuid() == 0
PATHS = [True, False] if udpio.have_sendmmsg() else [False]


def _receivers(n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        r.bind(("127.0.0.1", 0))
        r.setblocking(False)
        out.append(r)
    return out


def _read_all(r: socket.socket) -> list[bytes]:
    got = []
    try:
        while True:
            got.append(r.recv(4096))
    except BlockingIOError:
        return got


@pytest.mark.parametrize("mmsg", PATHS)
def test_a_batch_reaches_every_destination_in_order(mmsg: bool) -> None:
    rs = _receivers(3)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        b = SendBatch(s, use_sendmmsg=mmsg)
        want: list[list[bytes]] = [[], [], []]
        # More than one sendmmsg call's worth, sizes from empty to the largest copied,
        # and one larger (sent on its own path).
        for i in range(udpio.MAX_BATCH * 2 + 5):
            data = bytes([i % 251]) * (i * 7 % (udpio.MAX_DATAGRAM + 1))
            if i == 77:
                data = b"x" * (udpio.MAX_DATAGRAM + 100)
            k = i % 3
            b.add(data, rs[k].getsockname(), i)
            want[k].append(data)
        assert b.flush() == []
        assert b.pending == [] and b.flush() == []
        for r, w in zip(rs, want, strict=True):
            assert _read_all(r) == w
    finally:
        s.close()
        for r in rs:
            r.close()


@pytest.mark.parametrize("mmsg", PATHS)
def test_a_refused_datagram_is_reported_and_the_rest_still_go(mmsg: bool) -> None:
    (r,) = _receivers(1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # no SO_BROADCAST: EACCES
    try:
        b = SendBatch(s, use_sendmmsg=mmsg)
        b.add(b"one", r.getsockname(), "a")
        b.add(b"bcast", ("255.255.255.255", 9), "b")
        b.add(b"two", r.getsockname(), "c")
        b.add(b"bad", ("300.1.2.3", 9), "d")
        b.add(b"three", r.getsockname(), "e")
        failed = b.flush()
        why = {t: e for t, _, e in failed}
        assert sorted(why) == ["b", "d"]  # type: ignore[type-var]
        assert isinstance(why["b"], PermissionError) and isinstance(why["d"], OSError)
        assert _read_all(r) == [b"one", b"two", b"three"]
    finally:
        s.close()
        r.close()


_EAGAIN_CHILD = """
import json, socket, subprocess, sys
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
# A shaper that lets almost nothing out: queued datagrams stay charged to the socket.
subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "8bit",
                "burst", "1600", "limit", "1000000"], check=True)
from metald.boot.udpio import SendBatch
r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); r.bind(("127.0.0.1", 0))
out = {}
for mmsg in (True, False):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
    s.setblocking(False)
    b = SendBatch(s, use_sendmmsg=mmsg)
    for i in range(40):
        b.add(bytes(300), r.getsockname(), i)
    failed = b.flush()
    out[str(mmsg)] = [[t, type(e).__name__] for t, _, e in failed]
print(json.dumps(out))
"""


@pytest.mark.root
@pytest.mark.skipif(not ROOT, reason="needs root (a network namespace with a traffic shaper)")
def test_a_full_send_buffer_reports_the_rest_of_the_batch() -> None:
    repo = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", _EAGAIN_CHILD],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=repo,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for path, failed in out.items():
        if path == "True" and not udpio.have_sendmmsg():
            continue
        # Some went out before the buffer filled; every one after is reported, in order,
        # as EAGAIN; nothing is kept queued.
        tags = [t for t, _ in failed]
        assert failed and tags == list(range(40 - len(failed), 40)), (path, failed)
        assert {kind for _, kind in failed} == {"BlockingIOError"}
