"""The DHCP server's batched socket I/O (``metald.boot.dhcp._batchio``: recvmmsg, sendmmsg)
against one recvfrom/sendto per datagram, on real loopback sockets.

The C functions alone: what ``recv_batch`` returns is what recvfrom returns, datagram by
datagram and in order (cut one byte past what the parser accepts, so a longer datagram is
still refused as oversized), with random sizes and sources; ``send_batch`` delivers what
sendto delivers and reports a bad destination at its index. Then two servers, one with each
path, get the same datagrams (DORAs and malformed ones): the same replies, byte for byte, and
the same counters.
"""

from __future__ import annotations

import errno
import random
import shutil
import socket
import sysconfig
from pathlib import Path

import pytest

from metald.boot import metrics
from metald.boot.dhcp import server as server_mod
from metald.boot.dhcp.bootfile import BootFiles
from metald.boot.dhcp.lease_store import LeaseStore
from metald.boot.dhcp.packet import MAX_PACKET, MessageType, Opt, parse, serialize
from metald.boot.dhcp.server import DhcpServer
from metald.store.db import Store

from .dhcp_helpers import client_packet
from .test_dhcp_server import LO, plan


def test_the_extension_is_built_where_it_can_be() -> None:
    """Where a compiler and Python's headers are (bootstrap installs both), the editable
    install builds it: a silently missing module would make the tests below skip."""
    have_headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    if not (have_headers and shutil.which("cc")):
        pytest.skip("no C compiler or Python headers: one datagram per call is the only path")
    from metald.boot.dhcp import _batchio  # noqa: F401

    assert server_mod.BATCH_IO is not None


try:
    from metald.boot.dhcp._batchio import recv_batch, send_batch
except ImportError:
    recv_batch = send_batch = None

needs_c = pytest.mark.skipif(recv_batch is None, reason="metald.boot.dhcp._batchio not built")


def udp() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.setblocking(False)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    return s


def recv_all(s: socket.socket) -> list[tuple[bytes, tuple[str, int]]]:
    out = []
    while True:
        try:
            out.append(s.recvfrom(65535))
        except BlockingIOError:
            return out


@needs_c
def test_recv_batch_returns_what_recvfrom_returns() -> None:
    rnd = random.Random(33)
    server, other = udp(), udp()
    senders = [udp(), udp(), udp()]
    try:
        for _ in range(60):
            sizes = [
                rnd.choice([0, 1, 239, 240, 300, 548, MAX_PACKET, MAX_PACKET + 1, 5000, 60000])
                for _ in range(rnd.randint(0, 80))
            ]
            grams = [(rnd.randbytes(n), rnd.choice(senders)) for n in sizes]
            for data, s in grams:
                s.sendto(data, server.getsockname())
                s.sendto(data, other.getsockname())
            want = recv_all(other)
            assert len(want) == len(grams)  # nothing lost on loopback with these buffers
            limit = rnd.randint(0, 90)
            got, err = recv_batch(server.fileno(), limit, MAX_PACKET + 1)
            assert got == [(d[: MAX_PACKET + 1], a) for d, a in want[:limit]]
            # The limit reached: 0; the socket read empty first: EAGAIN.
            assert err == (0 if limit <= len(want) else errno.EAGAIN)
            assert [(d[: MAX_PACKET + 1], a) for d, a in recv_all(server)] == [
                (d[: MAX_PACKET + 1], a) for d, a in want[limit:]
            ]
        with pytest.raises(ValueError):
            recv_batch(server.fileno(), 4, 0)
        with pytest.raises(ValueError):
            recv_batch(-1, 4, 100)
        bad = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        fd = bad.fileno()
        bad.close()
        assert recv_batch(fd, 4, 100) == ([], errno.EBADF)  # the error recvfrom would raise
    finally:
        for s in (server, other, *senders):
            s.close()


@needs_c
def test_send_batch_delivers_what_sendto_delivers_and_reports_bad_destinations() -> None:
    rnd = random.Random(34)
    sender = udp()
    receivers = [udp(), udp()]
    try:
        for _ in range(40):
            items = []
            for _ in range(rnd.randint(0, 70)):
                r = rnd.random()
                if r < 0.08:
                    host, port = "not-an-address", 67
                elif r < 0.12:
                    host, port = "127.0.0.1", 70000
                else:
                    rcv = rnd.choice(receivers)
                    host, port = rcv.getsockname()
                items.append((rnd.randbytes(rnd.randint(0, 1500)), host, port))
            failed = send_batch(
                sender.fileno(),
                [i[0] for i in items],
                [i[1] for i in items],
                [i[2] for i in items],
            )
            bad = [
                k
                for k, (_, h, p) in enumerate(items)
                if h == "not-an-address" or not 0 <= p <= 65535
            ]
            assert failed == [(k, errno.EINVAL) for k in bad]
            for rcv in receivers:
                want = [
                    d
                    for k, (d, h, p) in enumerate(items)
                    if k not in bad and (h, p) == rcv.getsockname()
                ]
                assert [d for d, _ in recv_all(rcv)] == want
        with pytest.raises(ValueError):
            send_batch(sender.fileno(), [b"x"], [], [])
        with pytest.raises(TypeError):
            send_batch(sender.fileno(), ["not bytes"], ["127.0.0.1"], [67])
    finally:
        for s in (sender, *receivers):
            s.close()


def _counts() -> dict[tuple[str, str], float]:
    out = {}
    for c in (metrics.dhcp_dropped, metrics.dhcp_replies, metrics.dhcp_packets):
        for s in c.collect()[0].samples:
            if s.name.endswith("_total"):
                out[(s.name, next(iter(s.labels.values())))] = s.value
    return out


async def _serve(tmp_path: Path, batch_io: bool, rounds: list[list[bytes]]) -> tuple[list, dict]:
    """One server (the given I/O path) fed ``rounds`` of datagrams from one relay socket,
    each round drained by the server's own receive path and its commits made: the replies
    the relay got, and how every counter moved."""
    store = Store(f"sqlite:///{tmp_path / ('b' if batch_io else 's')}.db")
    store.migrate()
    relay = udp()
    leases = LeaseStore(store, clock=lambda: 1_800_000_000.0)
    srv = DhcpServer(
        mode="full",
        interfaces=["lo"],
        networks=[plan()],
        server_id=LO,
        files=BootFiles(http_base="http://127.0.0.1:1"),
        leases=leases,
        port=0,
        bind_host="127.0.0.1",
        relay_port=relay.getsockname()[1],
        clock=lambda: 1_800_000_000.0,
        batch_io=batch_io,
    )
    await srv.start()
    lst = srv._listeners[0]
    assert lst.batch is (batch_io and server_mod.BATCH_IO is not None)
    before = _counts()
    replies = []
    try:
        for grams in rounds:
            for g in grams:
                relay.sendto(g, lst.sock.getsockname())
            srv._drain(lst)
            await leases.drain()
            replies.append([d for d, _ in recv_all(relay)])
    finally:
        await srv.stop()
        leases.close()
        store.close()
        relay.close()
    after = _counts()
    return replies, {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


@needs_c
async def test_a_server_reading_and_sending_in_batches_answers_as_one_a_call(
    tmp_path: Path,
) -> None:
    """DISCOVERs, then REQUESTs for what was offered, with malformed datagrams between
    (too short, too long by one byte and by much, no cookie, a bad message type, a reply
    op): both paths send the same bytes in the same order and count the same."""
    rnd = random.Random(35)
    macs = [f"52:54:00:33:{i // 256:02x}:{i % 256:02x}" for i in range(120)]
    good = serialize(client_packet(MessageType.DISCOVER, macs[0], giaddr=LO))
    junk = [
        b"",
        b"\x01" * 100,
        good + bytes(MAX_PACKET + 1 - len(good)),
        good + bytes(6000),
        good[:236] + b"XXXX" + good[240:],
        good.replace(b"\x35\x01\x01", b"\x35\x01\x63", 1),
        b"\x02" + good[1:],
    ]

    def with_junk(grams: list[bytes]) -> list[bytes]:
        out = []
        for g in grams:
            out.append(g)
            if rnd.random() < 0.2:
                out.append(rnd.choice(junk))
        return out

    discovers = with_junk(
        [serialize(client_packet(MessageType.DISCOVER, m, giaddr=LO)) for m in macs]
    )
    # The REQUESTs name what the first round offered (the same on both sides, or the
    # comparison of the first round already failed).
    py_replies, _ = await _serve(tmp_path, False, [discovers])
    offers = [parse(r) for r in py_replies[0]]
    requests = with_junk(
        [
            serialize(
                client_packet(
                    MessageType.REQUEST,
                    o.mac,
                    giaddr=LO,
                    options={Opt.REQUESTED_IP: o.yiaddr.packed, Opt.SERVER_ID: LO.packed},
                )
            )
            for o in offers
        ]
    )
    rounds = [discovers, requests]
    (tmp_path / "py").mkdir()
    (tmp_path / "c").mkdir()
    py = await _serve(tmp_path / "py", False, rounds)
    c = await _serve(tmp_path / "c", True, rounds)
    assert len(py[0][0]) == len(macs) and len(py[0][1]) == len(macs)
    assert {parse(r).message_type for r in py[0][1]} == {MessageType.ACK}
    assert c[0] == py[0]
    assert c[1] == py[1]
    assert py[1][("metald_dhcp_dropped_total", "oversized")] >= 1
