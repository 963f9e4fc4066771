"""The TFTP server's per-transfer shell (``_Transfer``): its connected socket, the drain of
datagrams per wake-up, the send path's recovery from a queued ICMP error, and the silence
timer's retransmits and give-up. Real sockets on loopback, driven step by step (the shell's
callbacks are called directly, so nothing waits on time). Each test runs with the C lock-step
loop (``_fastack``, where it is built), with the server's hub (every transfer socket in one
epoll set served by ``_fastack.ready``, where it is built) and with the Python path."""

from __future__ import annotations

import asyncio
import select
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from metald.boot import metrics
from metald.boot.tftp.packet import Opcode, Request, negotiate
from metald.boot.tftp.server import FAST_DRAIN, FAST_READY, TftpServer, _Hub, _Transfer
from metald.boot.tftp.transfer import MAX_RETRIES, ReadTransfer

DATA = bytes(range(256)) * 20  # 5,120 bytes: 11 blocks of 512


def ack(n: int) -> bytes:
    return struct.pack("!HH", Opcode.ACK, n & 0xFFFF)


def block(pkt: bytes) -> int:
    assert pkt[:2] == b"\x00\x03", pkt
    return struct.unpack_from("!H", pkt, 2)[0]


def udp(addr: tuple[str, int] = ("127.0.0.1", 0)) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(addr)
    return s


def nothing_queued(s: socket.socket) -> bool:
    """Loopback delivers within the sender's call: what was sent is already queued."""
    return not select.select([s], [], [], 0)[0]


class Shell:
    """One transfer of ``DATA`` (plain RFC 1350, blksize 512) set up as the server sets it up:
    its own socket bound on loopback and connected to the client's."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, fast_drain: object, hub: _Hub | None = None
    ) -> None:
        self.hub = hub
        self.client = udp()
        self.client.settimeout(5)  # only so that a failure cannot hang the suite
        self.sock = udp()
        self.sock.setblocking(False)
        self.sock.connect(self.client.getsockname())
        self.machine = ReadTransfer(DATA, negotiate({}, len(DATA)))
        self.events: list[str] = []
        req = Request(Opcode.RRQ, "f", "octet", {})
        self.t = _Transfer(
            loop,
            self.sock,
            self.machine,
            self.client.getsockname(),
            req,
            lambda _t, ev: self.events.append(ev),
            fast_drain,  # type: ignore[arg-type]
            hub,
        )
        self.client.connect(self.sock.getsockname())

    def readable(self) -> None:
        """One wake-up of the event loop for this transfer: its own reader, or the hub's."""
        if self.hub is not None:
            self.hub._wake()
        else:
            self.t._readable()

    def close(self) -> None:
        self.t.close()
        self.client.close()
        if self.hub is not None:
            self.hub.close()


#: The C loop where it is built, and the Python path.
PATHS = [
    pytest.param(FAST_DRAIN, id="c", marks=pytest.mark.skipif(FAST_DRAIN is None, reason="no C")),
    pytest.param("hub", id="hub", marks=pytest.mark.skipif(FAST_READY is None, reason="no C")),
    pytest.param(None, id="python"),
]


@pytest.fixture(params=PATHS)
def shell(request: pytest.FixtureRequest) -> Iterator[Shell]:
    loop = asyncio.new_event_loop()
    if request.param == "hub":
        assert FAST_READY is not None
        sh = Shell(loop, FAST_DRAIN, _Hub(loop, *FAST_READY))
    else:
        sh = Shell(loop, request.param)
    try:
        yield sh
    finally:
        sh.close()
        loop.close()


def _dropped(reason: str) -> float:
    return metrics.tftp_dropped.labels(reason)._value.get()


def test_duplicate_acks_send_nothing_and_the_drain_reads_what_is_queued(shell: Shell) -> None:
    shell.t.start()
    assert block(shell.client.recv(2048)) == 1
    # ACK 1 three times (a client repeating itself, or the sorcerer's apprentice): one DATA 2.
    for _ in range(3):
        shell.client.send(ack(1))
    shell.readable()
    assert block(shell.client.recv(2048)) == 2
    assert nothing_queued(shell.client)
    assert shell.events == ["confirmed"] and shell.machine.acked == 1
    # Nothing left to read: a wake-up with an empty socket (EAGAIN) changes nothing.
    shell.readable()
    assert nothing_queued(shell.client) and shell.machine.sent == 2


def test_a_whole_transfer_in_lock_step(shell: Shell) -> None:
    """ACK by ACK to the end (after the first ACK, the C loop's case where it is built): the
    client gets the file, the last ACK ends the transfer once."""
    shell.t.start()
    got, n = [], 0
    while not shell.t.closed:
        pkt = shell.client.recv(2048)
        n = block(pkt)
        got.append(pkt[4:])
        shell.client.send(ack(n))
        shell.readable()
    assert b"".join(got) == DATA and n == shell.machine.nblocks
    assert shell.events == ["confirmed", "ok"] and nothing_queued(shell.client)


def test_the_drain_is_bounded_per_wake_up(shell: Shell) -> None:
    """A flood from the client's own address and port (the only one that reaches the socket)
    is read 64 datagrams per wake-up, so other transfers get their turn."""
    shell.t.start()
    shell.client.recv(2048)
    before = _dropped("truncated")
    for _ in range(100):
        shell.client.send(b"\x00")
    shell.readable()
    assert _dropped("truncated") - before == 64
    shell.readable()
    assert _dropped("truncated") - before == 100
    shell.client.send(ack(1))
    shell.readable()
    assert block(shell.client.recv(2048)) == 2


def test_a_queued_icmp_error_does_not_cost_a_packet(shell: Shell) -> None:
    """A connected UDP socket reports an ICMP error (the client's port closed for a moment, or
    a forged ICMP) by failing its next call once: the packet of that call is sent again."""
    addr = shell.client.getsockname()
    shell.client.close()
    shell.t._send([b"into the void"])  # port unreachable: the kernel queues ECONNREFUSED
    shell.client = udp(addr)
    shell.client.settimeout(5)
    shell.t._send([b"first", b"second"])
    assert shell.client.recv(2048) == b"first"
    assert shell.client.recv(2048) == b"second"


def test_silence_timer_resends_then_gives_up(shell: Shell) -> None:
    shell.t.start()
    shell.client.recv(2048)
    shell.client.send(ack(1))
    shell.readable()
    assert block(shell.client.recv(2048)) == 2
    timer = shell.t.timer
    # Not silent for the interval yet: nothing resent, the timer re-armed for the rest.
    shell.t._check()
    assert nothing_queued(shell.client) and shell.t.timer is not timer
    for i in range(MAX_RETRIES):
        shell.t.last -= shell.machine.interval  # as if the interval had passed in silence
        shell.t._check()
        assert block(shell.client.recv(2048)) == 2, i
        assert shell.events == ["confirmed"]
    shell.t.last -= shell.machine.interval
    shell.t._check()
    assert nothing_queued(shell.client)
    assert shell.events == ["confirmed", "timeout"] and shell.t.closed
    assert shell.sock.fileno() == -1  # the socket is closed and out of the event loop


@pytest.mark.parametrize("fast_ack", [True, False])
async def test_a_packet_from_another_tid_never_reaches_the_transfer(
    tmp_path: Path, fast_ack: bool
) -> None:
    """Only the client's address and port reach a transfer's socket: a stranger's forged ACK
    is refused by the kernel (ICMP port unreachable) and costs metald nothing; the real client
    goes on. (Before, metald read it and answered it with an ERROR packet.)"""
    (tmp_path / "f").write_bytes(DATA)
    server = TftpServer(tmp_path, host="127.0.0.1", port=0, fast_ack=fast_ack)
    await server.start()
    loop = asyncio.get_running_loop()
    client, stranger = udp(), udp(("127.0.0.2", 0))
    client.setblocking(False)
    stranger.setblocking(False)
    try:
        client.sendto(b"\x00\x01f\x00octet\x00", ("127.0.0.1", server.bound_port))
        first, tid = await asyncio.wait_for(loop.sock_recvfrom(client, 2048), 10)
        assert block(first) == 1
        before = _dropped("unknown-tid")
        stranger.connect(tid)
        stranger.send(ack(1))
        with pytest.raises(ConnectionRefusedError):
            await asyncio.wait_for(loop.sock_recv(stranger, 2048), 10)
        assert _dropped("unknown-tid") == before
        (t,) = server.table
        assert t.machine.acked == 0
        client.sendto(ack(1), tid)
        second, _ = await asyncio.wait_for(loop.sock_recvfrom(client, 2048), 10)
        assert block(second) == 2
    finally:
        client.close()
        stranger.close()
        await server.stop()


@pytest.mark.skipif(FAST_READY is None, reason="no C")
def test_one_hub_wake_up_serves_every_ready_transfer() -> None:
    """The server's hub: the transfer sockets are in its epoll set, not readers of their own
    on the loop; one wake-up answers the ACKs waiting on several transfers; a closed transfer
    leaves the set (its descriptor number can be reused by the next socket)."""
    assert FAST_READY is not None
    loop = asyncio.new_event_loop()
    hub = _Hub(loop, *FAST_READY)
    shells = [Shell(loop, FAST_DRAIN, hub) for _ in range(3)]
    try:
        for sh in shells:
            sh.t.start()
            assert block(sh.client.recv(2048)) == 1
            assert not loop.remove_reader(sh.sock.fileno())  # no reader of its own
            sh.client.send(ack(1))
        hub._wake()  # unconfirmed: served by Python, all three in this one wake-up
        for sh in shells:
            assert block(sh.client.recv(2048)) == 2 and sh.events == ["confirmed"]
            sh.client.send(ack(2))
        before = [sh.t.last for sh in shells]
        python_calls: list[object] = []
        for sh in shells:  # confirmed: the C loop answers all three, no Python drain runs
            sh.t._readable = python_calls.append  # type: ignore[method-assign]
        hub._wake()
        assert python_calls == []
        for sh, last in zip(shells, before, strict=True):
            assert block(sh.client.recv(2048)) == 3
            assert (sh.machine.acked, sh.machine.sent) == (1, 2)  # in the lane until taken
            sh.t._sync()
            assert (sh.machine.acked, sh.machine.sent) == (2, 3) and sh.t.last >= last
        assert set(hub.lanes) == {sh.sock.fileno() for sh in shells}
        shells[0].t.close()
        assert set(hub.lanes) == {sh.sock.fileno() for sh in shells[1:]}
        hub._wake()  # nothing ready: nothing sent
        assert all(nothing_queued(sh.client) for sh in shells[1:])
    finally:
        for sh in shells:
            sh.t.close()
            sh.client.close()
        hub.close()
        loop.close()


def test_a_send_the_hubs_c_loop_could_not_make_is_sent_again_from_python() -> None:
    """When C reports a failed send (a queued ICMP error arriving between its recv and its
    send fails that send once), the hub sends that block again from Python, then lets the
    transfer's drain read on. ``ready`` is replaced here by one that reports exactly that
    (the real one cannot be made to hit the race on demand); the socket and client are real."""
    loop = asyncio.new_event_loop()
    sh = Shell(loop, FAST_DRAIN)
    try:
        sh.t.start()
        assert block(sh.client.recv(2048)) == 1
        sh.client.send(ack(1))
        sh.t._readable()  # confirms: the shared packets are in use from here
        assert block(sh.client.recv(2048)) == 2
        m = sh.machine
        m.lockstep_advanced(2, 3)  # as C leaves it: ACK 2 handled, its DATA 3 not sent

        def ready(*_args: object) -> list[tuple[_Transfer, bytes | None, bool]]:
            return [(sh.t, None, True)]

        hub = _Hub(loop, ready)
        try:
            hub._wake()
        finally:
            hub.close()
        assert block(sh.client.recv(2048)) == 3 and nothing_queued(sh.client)
    finally:
        sh.close()
        loop.close()
