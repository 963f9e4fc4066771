"""The DHCP shell in-process on loopback: malformed floods are counted and dropped, the
server keeps answering, ACKs wait for the lease commit, hooks see booting clients once."""

from __future__ import annotations

import asyncio
import os
import socket
from ipaddress import IPv4Address, IPv4Network

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metald.boot import metrics
from metald.boot.dhcp.bootfile import BootFiles
from metald.boot.dhcp.common import NetworkPlan
from metald.boot.dhcp.lease_store import LeaseStore
from metald.boot.dhcp.packet import MessageType, Opt, encode_tlv, parse, serialize
from metald.boot.dhcp.server import DhcpServer, _Listener
from metald.boot.hooks import MemoryBootHooks

from .dhcp_helpers import IPXE_BIOS, client_packet

LO = IPv4Address("127.0.0.1")


def plan() -> NetworkPlan:
    return NetworkPlan(
        name="lo",
        subnet=IPv4Network("127.0.0.0/8"),
        pool_start=IPv4Address("127.0.1.1"),
        pool_end=IPv4Address("127.0.9.255"),
        lease_seconds=600,
    )


async def start(store, hooks=None):  # type: ignore[no-untyped-def]
    """A server on 127.0.0.1:<ephemeral>, replying to relays at our test socket's port."""
    relay = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    relay.bind(("127.0.0.1", 0))
    relay.setblocking(False)
    leases = LeaseStore(store)
    srv = DhcpServer(
        mode="full",
        interfaces=["lo"],
        networks=[plan()],
        server_id=LO,
        files=BootFiles(http_base="http://127.0.0.1:1"),
        leases=leases,
        hooks=hooks,
        port=0,
        bind_host="127.0.0.1",
        relay_port=relay.getsockname()[1],
    )
    await srv.start()
    return srv, relay, leases


async def recv(sock: socket.socket, timeout: float = 3.0):  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    return parse(await asyncio.wait_for(loop.sock_recv(sock, 2048), timeout))


async def dora(srv, relay, mac: str, extra=None):  # type: ignore[no-untyped-def]
    addr = srv._listeners[0].sock.getsockname()
    d = client_packet(MessageType.DISCOVER, mac, giaddr=LO, options=extra or {})
    relay.sendto(serialize(d), addr)
    off = await recv(relay)
    assert off.message_type is MessageType.OFFER
    r = client_packet(
        MessageType.REQUEST,
        mac,
        giaddr=LO,
        options={**(extra or {}), Opt.REQUESTED_IP: off.yiaddr.packed, Opt.SERVER_ID: LO.packed},
    )
    relay.sendto(serialize(r), addr)
    return await recv(relay)


def dropped(reason: str) -> float:
    return metrics.dhcp_dropped.labels(reason)._value.get()


async def test_flood_of_garbage_is_counted_and_service_continues(store) -> None:  # type: ignore[no-untyped-def]
    srv, relay, leases = await start(store)
    try:
        addr = srv._listeners[0].sock.getsockname()
        before = {
            r: dropped(r) for r in ("truncated-header", "no-magic-cookie", "truncated-option")
        }
        good = serialize(client_packet(MessageType.DISCOVER, giaddr=LO))
        for _ in range(200):
            relay.sendto(os.urandom(100), addr)  # truncated-header
            relay.sendto(good[:236] + b"XXXX" + good[240:], addr)  # no-magic-cookie
            relay.sendto(good[:240] + b"\x35\x01\x01\x0c\xff", addr)  # truncated-option
        await asyncio.sleep(0.3)
        for r, n in before.items():
            assert dropped(r) - n == 200, r
        ack = await dora(srv, relay, "52:54:00:12:34:56")
        assert ack.message_type is MessageType.ACK
    finally:
        await srv.stop()
        leases.close()
        relay.close()


async def test_ack_is_sent_only_after_commit_and_option82_reaches_hooks(store) -> None:  # type: ignore[no-untyped-def]
    hooks = MemoryBootHooks()
    srv, relay, leases = await start(store, hooks)
    try:
        o82 = {Opt.RELAY_AGENT: encode_tlv({1: b"Eth1/3", 2: b"leaf-1"})}
        ack = await dora(srv, relay, "52:54:00:00:00:0a", {**IPXE_BIOS, **o82})
        assert ack.options[Opt.BOOTFILE] == b"http://127.0.0.1:1/boot/52:54:00:00:00:0a.ipxe"
        assert ack.options[Opt.RELAY_AGENT] == o82[Opt.RELAY_AGENT]
        # The ACK left after its commit: a fresh store reading the database has the lease.
        fresh = LeaseStore(store)
        await fresh.load()
        fresh.close()
        rec = fresh.table.for_mac("lo", "52:54:00:00:00:0a")
        assert rec is not None and rec.ip == ack.yiaddr and rec.state == "bound"
        await asyncio.sleep(0.05)
        # DISCOVER and REQUEST both seen, but reported once.
        assert hooks.seen == [
            {
                "mac": "52:54:00:00:00:0a",
                "arch": "bios",
                "network": "lo",
                "relay_agent": {"circuit_id": "Eth1/3", "remote_id": "leaf-1"},
            }
        ]
        # A plain client (not booting) is not reported as a machine.
        await dora(srv, relay, "52:54:00:00:00:0b")
        assert len(hooks.seen) == 1
    finally:
        await srv.stop()
        leases.close()
        relay.close()


async def test_two_instances_on_one_database_never_share_an_address(store) -> None:  # type: ignore[no-untyped-def]
    a, ra, _ = await start(store)
    b, rb, _ = await start(store)
    try:
        got: dict[str, str] = {}
        for i in range(20):
            srv, relay = (a, ra) if i % 2 else (b, rb)
            mac = f"52:54:00:00:01:{i:02x}"
            for _ in range(3):  # a NAK (lost race) makes the client start over
                ack = await dora(srv, relay, mac)
                if ack.message_type is MessageType.ACK:
                    got[mac] = str(ack.yiaddr)
                    break
        assert len(got) == 20 and len(set(got.values())) == 20
    finally:
        for s, r in ((a, ra), (b, rb)):
            await s.stop()
            s.leases.close()
            r.close()


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(min_size=0, max_size=600))
def test_fuzz_handle_datagram_never_raises(data: bytes) -> None:
    srv = DhcpServer(
        mode="proxy", interfaces=[], networks=[plan()], server_id=LO, files=BootFiles(), leases=None
    )
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        good = serialize(client_packet(MessageType.DISCOVER, options=IPXE_BIOS))
        lst = _Listener(s, "lo", False)
        srv.handle_datagram(data, ("127.0.0.1", 68), lst)
        srv.handle_datagram(good[:240] + data, ("127.0.0.1", 68), lst)
    finally:
        s.close()
