"""Several DHCP instances on one provisioning network and one PostgreSQL: real DhcpServer,
LeaseStore, LeaseFeed and Membership objects, clients behind "a relay" with one helper address
per instance (every instance gets every packet, as a relay configured with all of them sends).

Each instance listens on its own loopback address (127.0.0.2, .3, .4); the relay is a socket on
127.0.0.1 the servers reply to. Packets are handed to each server's receive path in turn and the
test waits until each has answered or dropped them (``DhcpServer.idle``), so "exactly one
instance answered" is read from the relay socket, not from a timing.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network

import pytest
from sqlalchemy import text

from metald.boot import metrics
from metald.boot.dhcp.balance import rfc3074_hash
from metald.boot.dhcp.bootfile import BootFiles
from metald.boot.dhcp.common import NetworkPlan
from metald.boot.dhcp.lease_feed import LeaseFeed
from metald.boot.dhcp.lease_store import LeaseStore
from metald.boot.dhcp.packet import DhcpPacket, MalformedPacket, MessageType, Opt, parse, serialize
from metald.boot.dhcp.peers import DhcpPeers
from metald.boot.dhcp.server import DhcpServer
from metald.boot.plane import join_fleet
from metald.fleet.membership import Membership
from metald.store import Store
from tests.boot.dhcp_helpers import client_packet
from tests.fleet.test_membership import wait_for

RELAY = IPv4Address("127.0.0.1")
SUBNET = IPv4Network("127.0.0.0/8")
#: Fleet timings: short for the suite. METALD_TEST_FLEET_TIMINGS="2,10" measures the defaults.
HEARTBEAT_S, DEAD_AFTER_S = (
    float(x) for x in os.environ.get("METALD_TEST_FLEET_TIMINGS", "0.25,1.5").split(",")
)


def plan() -> NetworkPlan:
    return NetworkPlan(
        name="prov",
        subnet=SUBNET,
        pool_start=IPv4Address("127.0.1.1"),
        pool_end=IPv4Address("127.0.1.200"),
        lease_seconds=600,
    )


@pytest.fixture
def pg_store(pg_server) -> Iterator[Store]:  # type: ignore[no-untyped-def]
    s = Store(pg_server.new_database())
    s.migrate()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def relay() -> Iterator[socket.socket]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((str(RELAY), 0))
    s.setblocking(False)
    try:
        yield s
    finally:
        s.close()


@dataclass
class Node:
    name: str
    ip: IPv4Address
    fleet: Membership
    leases: LeaseStore
    srv: DhcpServer
    feed: LeaseFeed
    peers: DhcpPeers

    async def stop(self) -> None:
        await self.srv.stop()
        await self.peers.stop()
        await self.feed.stop()
        await self.fleet.stop()
        self.leases.close()


async def node(
    store: Store, name: str, ip: str, relay: socket.socket, *, feed: bool = True
) -> Node:
    m = Membership(
        store,
        name,
        heartbeat_s=HEARTBEAT_S,
        dead_after_s=DEAD_AFTER_S,
        serves={"provisioning_networks": [str(SUBNET)]},
    )
    await m.start()
    leases = LeaseStore(store)
    await leases.load()
    srv = DhcpServer(
        mode="full",
        interfaces=["lo"],
        networks=[plan()],
        server_id=IPv4Address(ip),
        files=BootFiles(http_base="http://127.0.0.1:1"),
        leases=leases,
        port=0,
        bind_host=ip,
        relay_port=relay.getsockname()[1],
    )
    lf, peers = join_fleet(srv, m, takeover_secs=10)
    await peers.start()
    if feed:
        await lf.start()
        await asyncio.wait_for(lf.connected.wait(), 10)
    await srv.start()
    return Node(name, IPv4Address(ip), m, leases, srv, lf, peers)


async def fleet_of(store: Store, relay: socket.socket, n: int) -> list[Node]:
    nodes = [await node(store, f"i{k}", f"127.0.0.{k + 2}", relay) for k in range(n)]
    names = {x.name for x in nodes}
    # Every instance sees all of them and split the buckets the same way.
    await wait_for(
        lambda: all(
            {m.name for m in x.fleet.live()} == names
            and x.srv.peers is not None
            and x.srv.peers.splits.get("prov") is not None
            and x.srv.peers.splits["prov"].owners == nodes[0].srv.peers.splits["prov"].owners  # type: ignore[union-attr]
            for x in nodes
        )
    )
    return nodes


def drain(relay: socket.socket) -> list[tuple[DhcpPacket, str]]:
    out = []
    while True:
        try:
            data, src = relay.recvfrom(4096)
        except BlockingIOError:
            return out
        try:
            out.append((parse(data), src[0]))
        except MalformedPacket:
            continue


async def send(
    nodes: list[Node], relay: socket.socket, pkt: DhcpPacket
) -> list[tuple[DhcpPacket, str]]:
    """``pkt`` from the relay to every instance; the replies once each has dealt with it."""
    data = serialize(pkt)
    for x in nodes:
        if x.srv._listeners:
            x.srv.handle_datagram(data, (str(RELAY), 67), x.srv._listeners[0])
    for x in nodes:
        await x.srv.idle()
    return [(r, src) for r, src in drain(relay) if r.xid == pkt.xid]


def mac(i: int) -> str:
    return f"52:54:00:aa:{i >> 8:02x}:{i & 255:02x}"


def discover(m: str, xid: int, secs: int = 0) -> DhcpPacket:
    p = client_packet(MessageType.DISCOVER, m, xid=xid, giaddr=RELAY)
    p.secs = secs
    return p


def selecting(m: str, xid: int, ip: IPv4Address, server: IPv4Address) -> DhcpPacket:
    opts = {Opt.REQUESTED_IP: ip.packed, Opt.SERVER_ID: server.packed}
    return client_packet(MessageType.REQUEST, m, xid=xid, giaddr=RELAY, options=opts)


def renewing(m: str, xid: int, ip: IPv4Address) -> DhcpPacket:
    return client_packet(MessageType.REQUEST, m, xid=xid, giaddr=RELAY, ciaddr=ip)


async def dora(
    nodes: list[Node], relay: socket.socket, m: str, xid: int
) -> tuple[IPv4Address, str]:
    """DORA through the relay: exactly one instance offers and it ACKs. (address, its name)."""
    offers = await send(nodes, relay, discover(m, xid))
    assert len(offers) == 1, (m, offers)
    off, src = offers[0]
    assert off.message_type is MessageType.OFFER
    acks = await send(nodes, relay, selecting(m, xid + 1, off.yiaddr, IPv4Address(src)))
    assert [(a.message_type, s) for a, s in acks] == [(MessageType.ACK, src)]
    return acks[0][0].yiaddr, next(x.name for x in nodes if str(x.ip) == src)


def owner_of(nodes: list[Node], m: str) -> str | None:
    split = nodes[0].srv.peers.splits["prov"]  # type: ignore[union-attr]
    return split.owners[rfc3074_hash(bytes.fromhex(m.replace(":", "")))]


def held_by_two(store: Store) -> list[tuple[str, int]]:
    """MACs holding more than one live binding (an address cannot: (network, ip) is unique)."""
    with store.session() as s:
        return list(
            s.execute(
                text(
                    "SELECT mac, count(*) FROM leases WHERE state = 'bound' AND expires_at > now()"
                    " GROUP BY mac HAVING count(*) > 1"
                )
            ).all()
        )


def ignored(reason: str) -> float:
    return metrics.dhcp_ignored.labels(reason)._value.get()


async def test_each_client_is_answered_by_exactly_its_owner(
    pg_store: Store, relay: socket.socket
) -> None:
    nodes = await fleet_of(pg_store, relay, 3)
    try:
        got: dict[str, list[str]] = {x.name: [] for x in nodes}
        addrs: dict[IPv4Address, str] = {}
        for i in range(60):
            ip, who = await dora(nodes, relay, mac(i), 1000 + 10 * i)
            assert who == owner_of(nodes, mac(i))
            assert addrs.setdefault(ip, mac(i)) == mac(i)
            got[who].append(mac(i))
        # The RFC 3074 buckets spread 60 clients over all three.
        assert all(len(v) >= 5 for v in got.values()), {k: len(v) for k, v in got.items()}
        # Each instance learnt the others' bindings from the feed (no read-through needed).
        for x in nodes:
            await wait_for(
                lambda x=x: all(x.leases.table.for_mac("prov", mac(i)) for i in range(60))
            )
        assert held_by_two(pg_store) == []
    finally:
        for x in nodes:
            await x.stop()


async def test_a_client_that_waited_is_answered_by_any_instance(
    pg_store: Store, relay: socket.socket
) -> None:
    a, b = nodes = await fleet_of(pg_store, relay, 2)
    try:
        m = next(mac(i) for i in range(100) if owner_of(nodes, mac(i)) == "i1")
        before = ignored("peer-client")
        assert [s for _, s in await send(nodes, relay, discover(m, 7, secs=9))] == [str(b.ip)]
        assert ignored("peer-client") == before + 1
        # secs reached dhcp_takeover_secs: its owner is alive but did not answer it.
        offers = await send(nodes, relay, discover(m, 8, secs=10))
        assert sorted(s for _, s in offers) == [str(a.ip), str(b.ip)]
    finally:
        for x in nodes:
            await x.stop()


async def test_survivor_takes_over_a_dead_instances_clients_and_keeps_their_addresses(
    pg_store: Store, relay: socket.socket
) -> None:
    a, b = nodes = await fleet_of(pg_store, relay, 2)
    try:
        theirs = [mac(i) for i in range(200) if owner_of(nodes, mac(i)) == "i1"][:10]
        bound = {m: (await dora(nodes, relay, m, 5000 + 10 * k)) for k, m in enumerate(theirs)}
        assert {who for _, who in bound.values()} == {"i1"}
        # i1 stops heartbeating (killed, or cut off from the store) while its server still
        # runs: it answers its clients until it fences itself, then nothing, and i0 takes
        # them once it judges i1 dead. At no moment do both answer.
        await b.fleet.stop_beats()
        killed = time.monotonic()
        newcomer = next(mac(i) for i in range(200, 400) if owner_of(nodes, mac(i)) == "i1")
        xid, phases = 9000, []
        while True:
            xid += 1
            replies = await send(nodes, relay, discover(newcomer, xid))
            assert len(replies) <= 1, replies
            phase = replies[0][1] if replies else "silent"
            if not phases or phases[-1] != phase:
                phases.append(phase)
            if phase == str(a.ip):
                answered = time.monotonic()  # i0's first answer has arrived by now
                break
            assert time.monotonic() - killed < DEAD_AFTER_S + 10 * HEARTBEAT_S + 5, phases
            await asyncio.sleep(0.05)  # the client's retransmission
        takeover = time.monotonic() - killed
        print(
            f"\nDHCP takeover: {takeover:.2f} s from the last heartbeat to a DISCOVER answered "
            f"by the survivor (heartbeat {HEARTBEAT_S} s, dead after {DEAD_AFTER_S} s); "
            f"answers seen: {phases}"
        )
        # i1 first, then silence (fenced), then i0: i1 fenced itself before i0 took over. The
        # silence can be shorter than one probe (a probe waits for replies), so i1 -> i0 with no
        # silent probe between passes too when i1's fence (its own clock: in-process) came
        # before i0's first answer arrived; never both in one probe (asserted above).
        assert phases in (
            [str(b.ip), "silent", str(a.ip)],
            ["silent", str(a.ip)],
            [str(b.ip), str(a.ip)],
        ), phases
        assert b.fleet.lease_until() < answered, (b.fleet.lease_until() - killed, takeover)
        await b.srv.stop()
        assert a.srv.peers is not None and not a.srv.peers.splits  # i0 answers everyone
        # Renewals at the survivor keep their addresses (i0 learnt i1's leases by the feed).
        for k, (m, (ip, _)) in enumerate(bound.items()):
            acks = await send(nodes, relay, renewing(m, 7000 + k, ip))
            assert [(r.message_type, r.yiaddr, s) for r, s in acks] == [
                (MessageType.ACK, ip, str(a.ip))
            ]
        assert held_by_two(pg_store) == []
    finally:
        for x in nodes:
            await x.stop()


async def test_renewal_at_another_instance_reads_the_lease_through_without_the_feed(
    pg_store: Store, relay: socket.socket
) -> None:
    """The survivor never heard of the lease (its feed is down): it reads the MAC's row from
    the store before deciding, and the client keeps its address instead of a NAK or a second
    address."""
    a = await node(pg_store, "i0", "127.0.0.2", relay, feed=False)
    b = await node(pg_store, "i1", "127.0.0.3", relay)
    nodes = [a, b]
    try:
        await wait_for(lambda: all(x.srv.peers.splits.get("prov") for x in nodes))  # type: ignore[union-attr]
        await wait_for(
            lambda: a.srv.peers.splits["prov"].owners == b.srv.peers.splits["prov"].owners
        )  # type: ignore[union-attr]
        m = next(mac(i) for i in range(100) if owner_of(nodes, mac(i)) == "i1")
        ip, who = await dora(nodes, relay, m, 100)
        assert who == "i1" and a.leases.table.for_mac("prov", m) is None
        await b.stop()  # a clean stop: i0 takes its clients at its next heartbeat
        await wait_for(lambda: not a.srv.peers.splits)  # type: ignore[union-attr]
        acks = await send([a], relay, renewing(m, 200, ip))
        assert [(r.message_type, r.yiaddr) for r, _ in acks] == [(MessageType.ACK, ip)]
        # A new DISCOVER from it is offered the same address too.
        offers = await send([a], relay, discover(m, 300))
        assert [r.yiaddr for r, _ in offers] == [ip]
        assert held_by_two(pg_store) == []
    finally:
        await a.stop()


async def test_a_fenced_instance_answers_nothing(pg_store: Store, relay: socket.socket) -> None:
    (a,) = nodes = [await node(pg_store, "i0", "127.0.0.2", relay)]
    try:
        ip, _ = await dora(nodes, relay, mac(1), 10)
        # Cut off from the store: no heartbeat is written any more.
        await a.fleet.stop_beats()
        await wait_for(lambda: a.fleet.fenced)
        before = ignored("fenced")
        for k, pkt in enumerate(
            (discover(mac(2), 20), renewing(mac(1), 21, ip), discover(mac(1), 22, secs=60))
        ):
            assert await send(nodes, relay, pkt) == [], k
        assert ignored("fenced") == before + 3
    finally:
        await a.stop()


def test_rfc3074_hash_spreads_macs_over_the_buckets() -> None:
    from metald.boot.dhcp.balance import MIX_TABLE, bucket_owners

    assert sorted(MIX_TABLE) == list(range(256))
    seen = {rfc3074_hash(bytes.fromhex(mac(i).replace(":", ""))) for i in range(4096)}
    assert len(seen) > 200
    two = bucket_owners("prov", ["a", "b"])
    three = bucket_owners("prov", ["a", "b", "c"])
    assert 80 < two.count("a") < 176
    # A third instance takes buckets only: none moves between the first two.
    assert all(t == o for t, o in zip(three, two, strict=True) if t != "c")
    assert 50 < three.count("c") < 120


@pytest.mark.parametrize("mode", ["load-balancing", "off"])
async def test_the_boot_plane_joins_the_fleet_as_configured(
    pg_store: Store, tmp_path, mode: str
) -> None:  # type: ignore[no-untyped-def]
    from metald.boot.hooks import MemoryBootHooks
    from metald.boot.plane import BootPlane
    from metald.config import load_config

    (tmp_path / "assets").mkdir()
    conf = tmp_path / "metald.toml"
    conf.write_text(
        f"""
[store]
url = "{pg_store.url}"
[boot]
enabled = true
dhcp_mode = "full"
interfaces = ["lo"]
server_address = "127.0.0.2"
assets_dir = "{tmp_path / "assets"}"
router_advertisements = false
dhcp_peers_mode = "{mode}"
dhcp_takeover_secs = 4
[[boot.networks]]
name = "prov"
subnet = "127.0.0.0/8"
pool_start = "127.0.1.1"
pool_end = "127.0.1.200"
"""
    )
    cfg = load_config(conf, environ={"METALD_STATE_DIR": str(tmp_path / "state")})
    m = Membership(pg_store, "i0", heartbeat_s=HEARTBEAT_S, dead_after_s=DEAD_AFTER_S)
    await m.start()
    plane = BootPlane(cfg, pg_store, MemoryBootHooks(), fleet=m)
    try:
        plane._join_peers()
        assert plane.dhcp is not None
        if mode == "off":
            assert plane.dhcp.peers is None and plane.feed is None
        else:
            assert plane.dhcp.peers is not None and plane.dhcp.peers.takeover_secs == 4
            assert plane.feed is not None and plane.services[:2] == [plane.feed, plane.dhcp.peers]
            assert plane.leases.notify_as == "i0"
    finally:
        plane.leases.close()
        await m.stop()


async def test_a_feed_that_was_down_reads_what_it_missed_when_it_comes_back(
    pg_store: Store, relay: socket.socket
) -> None:
    a, b = nodes = await fleet_of(pg_store, relay, 2)
    try:
        await a.feed.stop()  # i0 hears nothing of what i1 writes now
        m = next(mac(i) for i in range(100) if owner_of(nodes, mac(i)) == "i1")
        ip, _ = await dora(nodes, relay, m, 40)
        assert a.leases.table.for_mac("prov", m) is None
        await a.feed.start()
        await asyncio.wait_for(a.feed.connected.wait(), 10)
        rec = a.leases.table.for_mac("prov", m)
        assert rec is not None and rec.ip == ip and rec.state == "bound"
    finally:
        for x in nodes:
            await x.stop()
