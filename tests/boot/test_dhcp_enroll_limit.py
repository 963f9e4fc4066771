"""Enrollment rate limits on the DHCP side: a flood of made-up MACs from one port (or one
relay, or forged relays) creates a bounded number of machines, while 1,000 machines powering on
behind one relay all reach enrollment at once."""

from __future__ import annotations

import asyncio
from ipaddress import IPv4Address

from sqlmodel import func, select

from metald.boot import metrics
from metald.boot.dhcp.enroll_limit import (
    EnrollKeys,
    EnrollLimiter,
    EnrollLimits,
    Rate,
    TokenBuckets,
    keys_for,
)
from metald.boot.dhcp.packet import MessageType, Opt, encode_tlv, serialize
from metald.boot.hooks import MemoryBootHooks
from metald.boot.machine_hooks import StoreBootHooks
from metald.config import load_config
from metald.store.models import Machine

from .dhcp_helpers import IPXE_BIOS, client_packet
from .test_dhcp_server import start

LO = IPv4Address("127.0.0.1")


def mac(i: int, prefix: str = "02:00") -> str:
    return (
        f"{prefix}:{(i >> 24) & 255:02x}:{(i >> 16) & 255:02x}:{(i >> 8) & 255:02x}:{i & 255:02x}"
    )


def discover(m: str, *, giaddr: IPv4Address = LO, port: str | None = None) -> bytes:
    opts = dict(IPXE_BIOS)
    if port is not None:
        opts[Opt.RELAY_AGENT] = encode_tlv({1: port.encode(), 2: b"leaf-1"})
    return serialize(client_packet(MessageType.DISCOVER, m, giaddr=giaddr, options=opts))


def ignored(reason: str) -> float:
    return metrics.dhcp_ignored.labels(reason)._value.get()


# -- the pure core ----------------------------------------------------------------------


def test_token_bucket_burst_refill_and_clock_steps() -> None:
    b = TokenBuckets(Rate(3, 2))
    for _ in range(3):
        assert b.has("k", 10.0)
        b.take("k", 10.0)
    assert not b.has("k", 10.0)
    assert not b.has("k", 10.4)  # 0.8 tokens
    assert b.has("k", 10.5)  # 1 token after 0.5 s at 2/s
    assert b.tokens("k", 100.0) == 3  # never above the burst
    b.take("k", 100.0)
    assert b.tokens("k", 50.0) == 2  # a clock stepping back refills nothing
    off = TokenBuckets(Rate(0, 0))
    for _ in range(10):
        assert off.has("k", 0.0)
        off.take("k", 0.0)
    assert len(off) == 0


def test_bucket_map_is_bounded_and_forgets_full_buckets_first() -> None:
    b = TokenBuckets(Rate(2, 1), max_keys=100)
    b.take("busy", 0.0)
    b.take("busy", 0.0)  # empty: must survive the forgetting below if at all possible
    for i in range(99):
        b.take(i, 0.0)
    assert len(b) == 100
    b.take("new", 5.0)  # at 5 s every bucket but the newest is full again
    assert len(b) == 1
    for i in range(1000):
        b.take(("flood", i), 5.0)  # none full: the least recently used quarter goes
        assert len(b) <= 100


def test_port_limit_isolates_a_flooding_port_within_its_relay() -> None:
    lim = EnrollLimiter(EnrollLimits())
    flood = EnrollKeys(relay=1, source="10.0.0.1", port=(1, b"leaf-1", b"swp7"))
    admitted = sum(lim.admit(flood, 0.0) is None for _ in range(1000))
    assert admitted == 8
    assert lim.admit(flood, 0.0) == "port"
    # Neighbours behind the same relay are unaffected...
    for p in range(100):
        assert (
            lim.admit(EnrollKeys(1, "10.0.0.1", (1, b"leaf-1", f"swp{p + 10}".encode())), 0.0)
            is None
        )
    # ... and the flooding port gets one more a minute.
    assert lim.admit(flood, 59.0) == "port"
    assert lim.admit(flood, 60.0) is None


def test_relay_source_and_total_limits() -> None:
    lim = EnrollLimiter(EnrollLimits(relay=Rate(10, 1), source=Rate(15, 1), total=Rate(20, 1)))
    # No option 82: the relay's bucket is the limit.
    assert sum(lim.admit(EnrollKeys(1, "s1"), 0.0) is None for _ in range(50)) == 10
    assert lim.admit(EnrollKeys(1, "s1"), 0.0) == "relay"
    # Forged giaddrs from one source: the source's bucket.
    assert sum(lim.admit(EnrollKeys(100 + i, "s1"), 0.0) is None for i in range(50)) == 5
    assert lim.admit(EnrollKeys(999, "s1"), 0.0) == "source"
    # Forged sources too: the total.
    assert sum(lim.admit(EnrollKeys(200 + i, f"x{i}"), 0.0) is None for i in range(50)) == 5
    assert lim.admit(EnrollKeys(999, "y"), 0.0) == "total"
    # A refusal takes nothing: after 1 s exactly one more token everywhere.
    assert lim.admit(EnrollKeys(5000, "z"), 1.0) is None
    assert lim.admit(EnrollKeys(5001, "w"), 1.0) == "total"


def test_keys_from_packets() -> None:
    from metald.boot.dhcp.packet import parse

    relayed = parse(discover("02:00:00:00:00:01", giaddr=IPv4Address("10.1.0.1"), port="swp3"))
    k = keys_for(relayed, ("10.1.0.9", 67), "eth0")
    assert k == EnrollKeys(int(IPv4Address("10.1.0.1")), "10.1.0.9", (k.relay, b"leaf-1", b"swp3"))
    direct = parse(serialize(client_packet(MessageType.DISCOVER, options=IPXE_BIOS)))
    assert keys_for(direct, ("0.0.0.0", 68), "eth0") == EnrollKeys("eth0", "0.0.0.0", None)
    # Option 82 that does not parse is no port key, not an error.
    bad = client_packet(MessageType.DISCOVER, options={Opt.RELAY_AGENT: b"\x01\x09ab"})
    assert keys_for(bad, ("0.0.0.0", 68), "eth0").port is None


def test_config_knob_and_defaults() -> None:
    cfg = load_config(None, environ={})
    lim = EnrollLimits.from_config(cfg.boot.dhcp_enroll_limit)
    assert lim == EnrollLimits()
    assert lim.relay.burst >= 1000  # a rack storm of 1,000 behind one relay, at once
    cfg = load_config(None, environ={"METALD_BOOT__DHCP_ENROLL_LIMIT__PORT_BURST": "0"})
    assert EnrollLimits.from_config(cfg.boot.dhcp_enroll_limit).port == Rate(0, 1 / 60)


# -- through the server, with the store's hooks -------------------------------------------


async def settle(srv) -> None:  # type: ignore[no-untyped-def]
    """Wait until every hook call the server started has finished."""
    while srv._hook_tasks:
        await asyncio.wait(list(srv._hook_tasks))


async def send(srv, lst, packets: list[bytes], src: tuple[str, int] = ("127.0.0.1", 67)) -> None:  # type: ignore[no-untyped-def]
    # In batches the size of the hook backlog, waiting for the hooks between them, so that
    # every report the limiter admits really reaches the store.
    for i in range(0, len(packets), 50):
        for data in packets[i : i + 50]:
            srv.handle_datagram(data, src, lst)
        await settle(srv)


def machine_count(store) -> int:  # type: ignore[no-untyped-def]
    with store.session() as s:
        return s.exec(select(func.count()).select_from(Machine)).one()


async def test_flood_of_made_up_macs_from_one_port_creates_a_bounded_number_of_machines(
    store,
) -> None:  # type: ignore[no-untyped-def]
    srv, relay, leases = await start(store, StoreBootHooks(store, "t"))
    now = [1000.0]
    srv.clock = lambda: now[0]
    lst = srv._listeners[0]
    try:
        before = ignored("enroll-limited-port")
        await send(srv, lst, [discover(mac(i), port="swp7") for i in range(300)])
        assert machine_count(store) == 8
        assert ignored("enroll-limited-port") - before == 292
        # A real machine on another port of the same relay still enrolls.
        await send(srv, lst, [discover("52:54:00:aa:00:01", port="swp8")])
        assert machine_count(store) == 9
        # The flooding port gets one more a minute; the refused MACs were not marked as
        # reported, so they are tried again on their next packet.
        now[0] += 60
        await send(srv, lst, [discover(mac(i), port="swp7") for i in range(8, 20)])
        assert machine_count(store) == 10
    finally:
        await srv.stop()
        leases.close()
        relay.close()


async def test_flood_without_option_82_is_held_to_the_relay_limit(store) -> None:  # type: ignore[no-untyped-def]
    srv, relay, leases = await start(store, StoreBootHooks(store, "t"))
    srv.clock = lambda: 1000.0
    srv.enroll_limiter = EnrollLimiter(EnrollLimits(relay=Rate(20, 1), source=Rate(20, 1)))
    lst = srv._listeners[0]
    try:
        await send(srv, lst, [discover(mac(i)) for i in range(100)])
        assert machine_count(store) == 20
        # Forged giaddrs (all inside the served network) share the sender's source bucket.
        forged = [discover(mac(1000 + i), giaddr=IPv4Address(f"127.0.3.{i}")) for i in range(50)]
        await send(srv, lst, forged)
        assert machine_count(store) == 20
    finally:
        await srv.stop()
        leases.close()
        relay.close()


async def test_power_on_storm_of_1000_behind_one_relay_all_reported(store) -> None:  # type: ignore[no-untyped-def]
    """As bench/storm.py sends them: one relay, a port per machine, 32 ports per leaf, all
    within the same instant (the clock does not move): every one reaches enrollment."""
    hooks = MemoryBootHooks()
    srv, relay, leases = await start(store, hooks)
    srv.clock = lambda: 1000.0
    lst = srv._listeners[0]
    try:
        before = sum(ignored(f"enroll-limited-{k}") for k in ("port", "relay", "source", "total"))
        packets = []
        for i in range(1000):
            rack, port = divmod(i, 32)
            o82 = encode_tlv({1: f"swp{port + 1}".encode(), 2: f"leaf-r{rack + 1:03d}".encode()})
            opts = {**IPXE_BIOS, Opt.RELAY_AGENT: o82}
            packets.append(
                serialize(client_packet(MessageType.DISCOVER, mac(i), giaddr=LO, options=opts))
            )
        await send(srv, lst, packets)
        assert len({s["mac"] for s in hooks.seen}) == 1000
        after = sum(ignored(f"enroll-limited-{k}") for k in ("port", "relay", "source", "total"))
        assert after == before
    finally:
        await srv.stop()
        leases.close()
        relay.close()


async def test_only_six_byte_hardware_addresses_are_reported(store) -> None:  # type: ignore[no-untyped-def]
    """A machine is known by its MAC: a 16-byte or empty chaddr is answered but never handed
    to enrollment (the store would refuse it with a logged traceback per packet)."""
    hooks = MemoryBootHooks()
    srv, relay, leases = await start(store, hooks)
    lst = srv._listeners[0]
    try:
        for hlen in (16, 0, 6):
            pkt = client_packet(
                MessageType.DISCOVER, "52:54:00:00:00:01", giaddr=LO, options=IPXE_BIOS
            )
            pkt.chaddr, pkt.hlen = bytes(range(1, 17)), hlen
            srv.handle_datagram(serialize(pkt), ("127.0.0.1", 67), lst)
            await settle(srv)
        assert [s["mac"] for s in hooks.seen] == ["01:02:03:04:05:06"]
    finally:
        await srv.stop()
        leases.close()
        relay.close()
