"""The DHCP shell's receive path under load: a socket that had packets is polled every
``poll_interval`` instead of waking the loop per datagram, each poll drains at most
MAX_DRAIN datagrams, and a quiet socket is waited on again. Real sockets on loopback; SQLite
only (the socket path does not depend on the database)."""

from __future__ import annotations

import asyncio
import socket

from metald.boot import metrics
from metald.boot.dhcp import server as server_mod
from metald.boot.dhcp.packet import MessageType, parse, serialize
from tests.api_helpers import until

from .dhcp_helpers import client_packet
from .test_dhcp_server import LO, dora, start


def _dropped(reason: str) -> float:
    return metrics.dhcp_dropped.labels(reason)._value.get()


def _registered(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bool:
    """Whether the loop waits on ``sock`` (asyncio has no public query for it)."""
    try:
        loop._selector.get_key(sock.fileno())  # type: ignore[attr-defined]
    except KeyError:
        return False
    return True


async def test_burst_larger_than_a_drain_with_garbage_inside_is_answered_then_waited_on(
    sqlite_store, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(server_mod, "MAX_DRAIN", 8)
    srv, relay, leases = await start(sqlite_store)
    loop = asyncio.get_running_loop()
    lst = srv._listeners[0]
    try:
        addr = lst.sock.getsockname()
        before = {r: _dropped(r) for r in ("truncated-header", "no-magic-cookie")}
        good = serialize(client_packet(MessageType.DISCOVER, giaddr=LO))
        macs = [f"52:54:00:00:0b:{i:02x}" for i in range(40)]
        # All queued before the loop runs again: one wake-up finds 42 datagrams, 5x a drain.
        for i, mac in enumerate(macs):
            relay.sendto(serialize(client_packet(MessageType.DISCOVER, mac, giaddr=LO)), addr)
            if i == 10:
                relay.sendto(b"\x01" * 100, addr)  # truncated-header
            if i == 25:
                relay.sendto(good[:236] + b"XXXX" + good[240:], addr)  # no-magic-cookie
        offers: dict[str, MessageType | None] = {}

        def read_offers() -> bool:
            try:
                while True:
                    p = parse(relay.recv(2048))
                    offers[p.mac] = p.message_type
            except BlockingIOError:
                pass
            return len(offers) == len(macs)

        await until(read_offers, "an offer for every DISCOVER of the burst")
        assert set(offers) == set(macs) and set(offers.values()) == {MessageType.OFFER}
        assert {r: _dropped(r) - n for r, n in before.items()} == {
            "truncated-header": 1,
            "no-magic-cookie": 1,
        }
        # Under load the socket is polled, not waited on (one wake-up per poll, not per
        # datagram); once a poll finds nothing it is waited on again and no timer is left.
        await until(lambda: lst.poll is None, "the socket to be waited on again")
        assert _registered(loop, lst.sock)
        assert srv._counts == {}
        # The path back from polling loses nothing: a DORA on the quiet server completes.
        ack = await dora(srv, relay, "52:54:00:00:0b:ff")
        assert ack.message_type is MessageType.ACK
    finally:
        await srv.stop()
        leases.close()
        relay.close()


async def test_a_drain_stops_at_its_bound_and_polls_on_soon(sqlite_store, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(server_mod, "MAX_DRAIN", 4)
    srv, relay, leases = await start(sqlite_store)
    loop = asyncio.get_running_loop()
    lst = srv._listeners[0]
    try:
        addr = lst.sock.getsockname()
        for i in range(6):
            relay.sendto(
                serialize(
                    client_packet(MessageType.DISCOVER, f"52:54:00:0c:00:{i:02x}", giaddr=LO)
                ),
                addr,
            )
        # Empty socket: the drain ends on EAGAIN at once and handles nothing.
        empty = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        empty.bind(("127.0.0.1", 0))
        empty.setblocking(False)
        try:
            assert srv._drain(server_mod._Listener(empty, "lo", False)) == 0
        finally:
            empty.close()
        # A full drain (the bound reached) reads on in the next loop pass, not after the
        # poll interval; the rest (2) then waits for the interval.
        srv.poll_interval = 3600.0
        srv._readable(lst)
        assert isinstance(lst.poll, asyncio.Handle)
        assert not isinstance(lst.poll, asyncio.TimerHandle)
        assert not _registered(loop, lst.sock)
        await until(lambda: isinstance(lst.poll, asyncio.TimerHandle), "the second drain")
        got = 0
        try:
            while True:
                relay.recv(2048)
                got += 1
        except BlockingIOError:
            pass
        assert got == 6
        # Stopping while polling cancels the poll and closes the socket.
        poll = lst.poll
        await srv.stop()
        assert poll.cancelled() and lst.sock.fileno() == -1
    finally:
        await srv.stop()
        leases.close()
        relay.close()
