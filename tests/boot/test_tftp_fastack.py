"""The C lock-step ACK loop (``metald.boot.tftp._fastack``) against the Python drain.

Two transfers of the same file, one drained by the C loop and one by the Python path, each on
its own real socket pair, get the same datagrams step by step (in-order ACKs and bursts of
them, duplicates, out-of-order and far ACKs, ERRORs, garbage, short and long packets, the last
ACK, timeouts); after every step what each client received, the transfer's state, its events
and the drop counters must be equal; the C side is drained either by the transfer's own call
(``drain``) or by the server's hub (``ready``: every transfer socket in one epoll set). Then
the C function alone against random datagrams and
bad arguments: memory safety is checked by it never sending anything but the packet the state
says, never reading past the list, and refusing inconsistent state.
"""

from __future__ import annotations

import asyncio
import random
import select
import shutil
import socket
import struct
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metald.boot import metrics
from metald.boot.tftp import server
from metald.boot.tftp.packet import ErrorCode, Opcode, Request, error_packet, negotiate
from metald.boot.tftp.server import _Hub, _Transfer
from metald.boot.tftp.transfer import PacketCache, ReadTransfer
from metald.config import load_config


def test_the_extension_is_built_where_it_can_be() -> None:
    """Where a compiler and Python's headers are (bootstrap installs both), the editable
    install builds the C loop: a silently missing module would make the tests below skip."""
    have_headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    if not (have_headers and shutil.which("cc")):
        pytest.skip("no C compiler or Python headers: the Python path is the only one")
    from metald.boot.tftp import _fastack  # noqa: F401


try:
    from metald.boot.tftp._fastack import Lane, drain, ready
except ImportError:  # not built here: the test above says whether it should have been
    drain = ready = Lane = None

#: The tests below need the built module (the test above fails where it should be built).
needs_c = pytest.mark.skipif(drain is None, reason="metald.boot.tftp._fastack not built")


def ack(n: int) -> bytes:
    return struct.pack("!HH", Opcode.ACK, n & 0xFFFF)


def dropped() -> dict[str, float]:
    return {
        s.labels["reason"]: s.value
        for s in metrics.tftp_dropped.collect()[0].samples
        if s.name.endswith("_total")
    }


def delta(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in dropped().items() if v != before.get(k, 0)}


class Side:
    """One transfer set up as the server sets it up (a non-blocking socket connected to the
    client's), drained by the C loop or by Python."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fast: bool,
        data: bytes,
        opts: dict[str, str],
        family: int = socket.AF_INET,
        hub: bool = False,
    ) -> None:
        #: The server's hub (C ``ready``) drains this transfer's socket; else its own reader.
        self.hub = _Hub(loop, ready, Lane) if hub else None
        if family == socket.AF_INET:
            self.client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.client.bind(("127.0.0.1", 0))
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.sock.bind(("127.0.0.1", 0))
            self.sock.connect(self.client.getsockname())
            self.client.connect(self.sock.getsockname())
        else:
            self.sock, self.client = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.client.setblocking(False)
        self.machine = ReadTransfer(data, negotiate(opts, len(data)), packets=PacketCache())
        self.events: list[str] = []
        self.t = _Transfer(
            loop,
            self.sock,
            self.machine,
            ("127.0.0.1", 1),
            Request(Opcode.RRQ, "f", "octet", opts),
            lambda _t, ev: self.events.append(ev),
            drain if fast else None,
            self.hub,
        )

    def readable(self) -> None:
        """One wake-up of the event loop for this transfer: its own reader, or the hub's."""
        if self.hub is not None:
            self.hub._wake()
        else:
            self.t._readable()

    def settle(self) -> None:
        """Event-loop turns for this transfer until its socket is read empty: the hub reads
        one datagram per socket per wake-up (HUB_READS), the transfer's own drain up to 64."""
        for _ in range(1000):
            if self.t.closed or not select.select([self.sock], [], [], 0)[0]:
                return
            self.readable()
        raise AssertionError("the socket never went quiet")

    def received(self) -> list[bytes]:
        out = []
        while True:
            try:
                out.append(self.client.recv(4096))
            except BlockingIOError:
                return out

    def state(self) -> tuple[object, ...]:
        self.t._sync()  # what the hub's C loop advanced, taken back as the shell takes it
        m = self.machine
        return (
            m.acked,
            m.sent,
            m.recover,
            m.retries,
            m.budget,
            m.result,
            m.confirmed,
            m.oack_pending,
            self.events,
            self.t.closed,
            self.t.confirmed,
        )

    def close(self) -> None:
        self.t.close()
        self.client.close()
        if self.hub is not None:
            self.hub.close()


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def datagrams(m: ReadTransfer, kind: str, arg: int, raw: bytes) -> list[bytes]:
    """What the client sends this step, from the transfer's state (both sides share it)."""
    if kind == "next":
        return [ack(m.sent)]
    if kind == "burst":  # a client running ahead: in-order ACKs queued before a wake-up
        return [ack(m.sent + i) for i in range(arg)]
    if kind == "near":  # duplicates, partial and too-far ACKs around the window
        return [ack(m.sent + arg)]
    if kind == "num":
        return [ack(arg)]
    if kind == "long":  # an in-order ACK with trailing bytes: Python answers it too
        return [ack(m.sent) + raw[:1] + b"x"]
    if kind == "short":
        return [ack(m.sent)[: arg % 4]]
    if kind == "huge":  # longer than the 2,048-byte receive buffer: both truncate it
        return [ack(m.sent) + bytes(3000)]
    if kind == "error":
        return [error_packet(ErrorCode.UNDEFINED, "stop")]
    if kind == "garbage":
        return [raw]
    if kind == "mixed":  # in-order ACKs with something else between them
        return [ack(m.sent), raw, ack(m.sent + 1), ack(m.sent + 1)]
    return []


steps = st.lists(
    st.tuples(
        st.sampled_from(
            ["next"] * 6
            + ["burst"] * 3
            + ["near", "num", "long", "short", "huge", "error", "garbage", "mixed", "timeout"]
        ),
        st.integers(-3, 70),
        st.binary(max_size=8),
    ),
    max_size=40,
)


@needs_c
@settings(max_examples=120, deadline=None)
@given(
    size=st.integers(0, 1500),
    opts=st.sampled_from(
        [{}, {"blksize": "8"}, {"blksize": "16", "tsize": "0"}, {"blksize": "8", "windowsize": "2"}]
    ),
    family=st.sampled_from([socket.AF_INET, socket.AF_UNIX]),
    via_hub=st.booleans(),
    plan=steps,
)
def test_the_c_drain_answers_as_the_python_drain(
    size: int,
    opts: dict[str, str],
    family: int,
    via_hub: bool,
    plan: list[tuple[str, int, bytes]],
) -> None:
    data = (bytes(range(256)) * 6)[:size]
    loop = asyncio.new_event_loop()
    c = Side(loop, True, data, opts, family, hub=via_hub)
    py = Side(loop, False, data, opts, family)
    try:
        c.t.start()
        py.t.start()
        assert c.received() == py.received()
        # Confirm first most of the time (the C loop only runs on a confirmed transfer).
        plan = [("num", 0 if c.machine.oack_pending else 1, b"")] + plan
        for kind, arg, raw in plan:
            if c.t.closed:
                break
            assert c.state() == py.state()
            if kind == "timeout":
                for side in (c, py):
                    side.t.last -= side.machine.interval
                    side.t._check()
            else:
                for d in datagrams(c.machine, kind, arg, raw):
                    c.client.send(d)
                    py.client.send(d)
                # Through the hub, compared after the loop's turns until both sockets are
                # read empty (its per-wake-up bound differs: test_the_hub_reads_one_...).
                before = dropped()
                c.settle() if via_hub else c.readable()
                c_drops = delta(before)
                before = dropped()
                py.settle() if via_hub else py.t._readable()
                assert c_drops == delta(before)
            assert c.received() == py.received(), kind
            assert c.state() == py.state(), kind
        # Then a well-behaved client to the end: the last ACK ends both the same way.
        for _ in range(400):
            if c.t.closed:
                break
            a = ack(c.machine.sent)
            for side in (c, py):
                side.client.send(a)
                side.settle()
            assert c.received() == py.received()
            assert c.state() == py.state()
    finally:
        c.close()
        py.close()
        loop.close()


@needs_c
def test_the_c_drain_is_bounded_per_wake_up(loop: asyncio.AbstractEventLoop) -> None:
    """A client queueing 100 in-order ACKs gets 64 answered per wake-up, as in Python, so
    other transfers get their turn; the answers are the file's blocks in order."""
    data = bytes(range(256)) * 8  # 2,048 bytes: 256 blocks of 8
    c = Side(loop, True, data, {"blksize": "8"})
    try:
        c.t.start()
        assert c.received()[0].startswith(b"\x00\x06")  # the OACK
        c.client.send(ack(0))
        c.readable()
        assert c.received() == [c.machine._packets[0]]  # type: ignore[index]
        for n in range(1, 101):
            c.client.send(ack(n))
        c.readable()
        got = c.received()
        assert got == c.machine._packets[1:65]  # type: ignore[index]
        assert (c.machine.acked, c.machine.sent) == (64, 65)
        c.readable()
        assert c.received() == c.machine._packets[65:101]  # type: ignore[index]
        assert (c.machine.acked, c.machine.sent) == (100, 101)
    finally:
        c.close()


@needs_c
def test_the_hub_reads_one_datagram_per_socket_per_wake_up_from_its_lane(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Through the hub, a client queueing 100 in-order ACKs gets one answered per wake-up
    (the level-triggered set reports the socket again while it holds more), each from the
    transfer's lane in C: no Python drain runs and the transfer's own state moves only when
    it takes the lane's back (``_sync``), which gives exactly the state the Python path
    reaches."""
    data = bytes(range(256)) * 8  # 2,048 bytes: 256 blocks of 8
    c = Side(loop, True, data, {"blksize": "8"}, hub=True)
    try:
        c.t.start()
        assert c.received()[0].startswith(b"\x00\x06")  # the OACK
        c.client.send(ack(0))
        c.readable()  # confirms (through Python): the lane is armed from here
        packets = c.machine._packets
        assert packets is not None and c.received() == [packets[0]]
        assert c.t.lane.armed
        for n in range(1, 101):
            c.client.send(ack(n))
        python_calls: list[object] = []
        readable, c.t._readable = c.t._readable, python_calls.append  # type: ignore[method-assign]
        c.readable()
        assert c.received() == [packets[1]]
        assert (c.machine.acked, c.machine.sent) == (0, 1)  # still in the lane
        for _ in range(99):
            c.readable()
        assert c.received() == packets[2:101] and python_calls == []
        c.readable()  # nothing queued: nothing sent
        assert c.received() == []
        c.t._readable = readable  # type: ignore[method-assign]
        c.t._sync()
        assert (c.machine.acked, c.machine.sent, c.machine.retries) == (100, 101, 0)
        assert c.t._sync() is None and (c.machine.acked, c.machine.sent) == (100, 101)
    finally:
        c.close()


@needs_c
def test_a_lane_refuses_inconsistent_state_and_a_closed_transfer_leaves_none() -> None:
    """``Lane.arm`` checks the state as ``drain`` does; ``ready`` refuses a map that holds
    anything but lanes; a transfer's close disarms its lane and drops it (no cycle)."""
    lane = Lane(object())
    packets = [b"\x00\x03\x00\x01", b"\x00\x03\x00\x02"]
    for acked, sent, nblocks in [(-1, 0, 2), (1, 0, 2), (0, 3, 2), (0, 1, 3), (0, 0, -1)]:
        with pytest.raises(ValueError):
            lane.arm(packets, acked, sent, nblocks)
    with pytest.raises(TypeError):
        lane.arm(tuple(packets), 0, 1, 2)
    assert not lane.armed and lane.take() is None
    lane.arm(packets, 0, 1, 2)
    assert lane.armed and lane.take() is None  # armed, nothing advanced yet
    ep = select.epoll()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        ep.register(a.fileno(), select.EPOLLIN)
        b.send(ack(1))
        with pytest.raises(TypeError):
            ready(ep.fileno(), {a.fileno(): "not a lane"}, 0.0, 1)
        assert ready(ep.fileno(), {a.fileno(): lane}, 7.0, 1) == []
        assert b.recv(64) == packets[1] and lane.take() == (1, 2, 7.0)
    finally:
        ep.close()
        a.close()
        b.close()
    loop = asyncio.new_event_loop()
    c = Side(loop, True, b"x" * 100, {"blksize": "8"}, hub=True)
    try:
        c.t.start()
        lane = c.t.lane
        assert lane is not None and lane.transfer is c.t
        c.t.close()
        assert c.t.lane is None and not lane.armed and c.hub is not None and not c.hub.lanes
    finally:
        c.close()
        loop.close()


@pytest.mark.parametrize(
    "fast", [pytest.param(True, marks=needs_c), pytest.param("hub", marks=needs_c), False]
)
def test_a_send_that_fails_is_retried_and_the_state_still_advances(
    loop: asyncio.AbstractEventLoop, fast: bool | str
) -> None:
    """The client's queue full (a Unix datagram pair refuses with EAGAIN; loopback UDP never
    does): the ACK still counts, the packet is lost, and the silence timer resends it once
    the client reads again. The same with both paths."""
    data = bytes(range(256)) * 2
    s = Side(loop, bool(fast), data, {"blksize": "8"}, socket.AF_UNIX, hub=fast == "hub")
    try:
        s.t.start()
        assert s.received()[0].startswith(b"\x00\x06")  # the OACK
        s.client.send(ack(0))
        s.readable()
        assert s.received() == [s.machine._packets[0]]  # type: ignore[index]
        filler = 0
        while True:
            try:
                s.sock.send(b"filler")
            except BlockingIOError:
                break
            filler += 1
        s.client.send(ack(1))
        s.readable()
        assert (s.machine.acked, s.machine.sent) == (1, 2)
        assert s.received() == [b"filler"] * filler  # block 2 did not go
        s.t.last -= s.machine.interval
        s.t._check()
        assert s.received() == [s.machine._packets[1]]  # type: ignore[index]
    finally:
        s.close()


@needs_c
def test_the_python_path_is_chosen_when_asked_or_when_the_module_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert server._fast_drain() is drain
    assert server.TftpServer("/nonexistent").fast_drain is drain
    assert server.TftpServer("/nonexistent", fast_ack=False).fast_drain is None
    cfg = load_config(None, {"METALD_BOOT__TFTP_FAST_ACK": "false"})
    assert cfg.boot.tftp_fast_ack is False and load_config(None, {}).boot.tftp_fast_ack
    monkeypatch.setitem(sys.modules, "metald.boot.tftp._fastack", None)  # ImportError
    assert server._fast_drain() is None


@needs_c
def test_random_datagrams_never_make_it_send_anything_but_the_next_block() -> None:
    """A quick fuzz of the C function alone: random datagrams (any length up to 3,000 bytes,
    ACK-shaped ones with any number) at random consistent states; it sends only
    ``packets[acked]`` for each ACK it handles and hands everything else back intact."""
    rnd = random.Random(18)
    packets = [struct.pack("!HH", 3, n & 0xFFFF) + bytes([n & 0xFF]) * 5 for n in range(1, 41)]
    sock, client = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    client.setblocking(False)
    try:
        for _ in range(1500):
            nblocks = rnd.randint(0, len(packets))
            sent = rnd.randint(0, nblocks)
            acked = rnd.randint(max(0, sent - 2), sent)
            grams = []
            for _ in range(rnd.randint(0, 5)):
                r = rnd.random()
                if r < 0.5:
                    g = ack(sent + rnd.randint(-1, 2) + len(grams))
                elif r < 0.7:
                    g = bytes([0, 4]) + rnd.randbytes(rnd.choice([0, 1, 2, 3]))
                else:
                    g = rnd.randbytes(rnd.randint(0, 3000))
                grams.append(g)
                client.send(g)
            limit = rnd.randint(0, 8)
            handled, a, s, datagram, failed = drain(
                sock.fileno(), packets, acked, sent, nblocks, limit
            )
            assert not failed and 0 <= handled <= limit
            assert s == sent + handled and a == (s - 1 if handled else acked)
            assert s <= nblocks
            out = []
            while True:
                try:
                    out.append(client.recv(4096))
                except BlockingIOError:
                    break
            assert out == packets[sent : sent + handled]
            for g in grams[:handled]:
                assert len(g) == 4 and g[:2] == b"\x00\x04"
            if datagram is not None:
                assert datagram == grams[handled][:2048]
            rest = 1 if datagram is not None else 0
            while True:  # what it did not read stays queued for the next call
                try:
                    sock.recv(4096)
                    rest += 1
                except BlockingIOError:
                    break
            assert handled + rest == len(grams)
    finally:
        sock.close()
        client.close()


@needs_c
def test_inconsistent_state_or_arguments_are_refused() -> None:
    sock, client = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    client.setblocking(False)
    packets = [b"\x00\x03\x00\x01", b"\x00\x03\x00\x02"]
    try:
        for acked, sent, nblocks in [(-1, 0, 2), (1, 0, 2), (0, 3, 2), (0, 1, 3), (0, 0, -1)]:
            with pytest.raises(ValueError):
                drain(sock.fileno(), packets, acked, sent, nblocks, 4)
        with pytest.raises(ValueError):
            drain(-1, packets, 0, 1, 2, 4)
        with pytest.raises(TypeError):
            drain(sock.fileno(), tuple(packets), 0, 1, 2, 4)
        client.send(ack(1))
        with pytest.raises(TypeError):  # an element that is not bytes: nothing sent
            drain(sock.fileno(), [b"x", "not bytes"], 0, 1, 2, 4)
        with pytest.raises(BlockingIOError):
            client.recv(4096)
        # A closed descriptor: the recv fails and the drain just stops, as Python's does.
        bad = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        fd = bad.fileno()
        bad.close()
        assert drain(fd, packets, 0, 1, 2, 4) == (0, 0, 1, None, False)
    finally:
        sock.close()
        client.close()
