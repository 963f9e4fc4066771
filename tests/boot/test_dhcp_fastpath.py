"""The hot-path shortcuts keep the slow path's answers: cached timestamps, address and option
caches (bounded), the int-keyed lease table, per-network precomputed checks, commit
coalescing, and counters added once per wake-up."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from ipaddress import IPv4Address, IPv4Network

from hypothesis import given
from hypothesis import strategies as st

from metald.boot import metrics
from metald.boot.dhcp import packet
from metald.boot.dhcp.common import NetworkPlan
from metald.boot.dhcp.lease_store import (
    LeaseRecord,
    LeaseState,
    LeaseStore,
    LeaseTable,
    WriteResult,
    _sqlite_ts,
)
from metald.boot.dhcp.packet import MessageType, Opt, parse, serialize

from .dhcp_helpers import client_packet
from .test_dhcp_server import LO, dora, start


@given(
    st.one_of(
        st.floats(min_value=0, max_value=4e9, allow_nan=False),
        st.integers(0, 4_000_000_000).map(float),
        st.tuples(st.integers(0, 4_000_000_000), st.sampled_from([5e-7, 0.9999995, 0.1234565])).map(
            lambda t: t[0] + t[1]
        ),
    )
)
def test_sqlite_ts_matches_datetime(ts: float) -> None:
    assert _sqlite_ts(ts) == datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def test_address_and_option_caches_are_bounded_and_shared() -> None:
    for i in range(packet._ADDRS_MAX + 10):
        gi = IPv4Address(0x0A000000 + i)
        p = parse(serialize(client_packet(MessageType.DISCOVER, giaddr=gi)))
        assert p.giaddr == gi
        assert len(packet._ADDRS) <= packet._ADDRS_MAX
        raw = serialize(p)
        assert raw[24:28] == gi.packed
    a = parse(serialize(client_packet(MessageType.DISCOVER, giaddr=LO)))
    b = parse(serialize(client_packet(MessageType.DISCOVER, giaddr=LO)))
    assert a.giaddr is b.giaddr  # one object for a relay's address
    for i in range(packet._ENCODED_MAX + 10):
        v = i.to_bytes(4, "big")
        p = client_packet(MessageType.OFFER, options={Opt.LEASE_TIME: v})
        assert parse(serialize(p)).options[Opt.LEASE_TIME] == v
        assert len(packet._ENCODED) <= packet._ENCODED_MAX


@given(st.integers(0, 2**32 - 1), st.sampled_from(["", "52:54:00:00:00:01"]))
def test_network_plan_checks_match_ipaddress(n: int, mac: str) -> None:
    plan = NetworkPlan(
        name="p",
        subnet=IPv4Network("10.0.0.0/22"),
        pool_start=IPv4Address("10.0.1.0"),
        pool_end=IPv4Address("10.0.2.255"),
        lease_seconds=600,
        reservations={"52:54:00:00:00:01": IPv4Address("10.0.1.7")} if mac else {},
    )
    ip = IPv4Address(n)
    assert plan.contains(ip) == (ip in plan.subnet)
    reserved = plan.reservations.get(mac)
    want = (
        ip == reserved
        if reserved is not None
        else plan.pool_start <= ip <= plan.pool_end and ip not in plan.reserved
    )
    assert plan.assignable(ip, mac) == want
    assert plan.lease_options[Opt.LEASE_TIME] == (600).to_bytes(4, "big")


def test_lease_table_by_address_and_mac() -> None:
    t = LeaseTable()
    ip = IPv4Address("10.0.0.5")
    t.put(LeaseRecord("n", ip, "aa", LeaseState.BOUND, 2000.0))
    assert t.get("n", IPv4Address("10.0.0.5")).mac == "aa"  # type: ignore[union-attr]
    assert t.get("other", ip) is None and t.for_mac("other", "aa") is None
    # Another MAC takes the address over: the old MAC no longer points at it.
    t.put(LeaseRecord("n", ip, "bb", LeaseState.BOUND, 3000.0))
    assert t.for_mac("n", "aa") is None and t.for_mac("n", "bb").ip == ip  # type: ignore[union-attr]
    assert len(t) == 1 and [r.mac for r in t.records()] == ["bb"]
    start, end = IPv4Address("10.0.0.5"), IPv4Address("10.0.0.7")
    skip = frozenset({IPv4Address("10.0.0.6")})
    assert t.find_free("n", start, end, 2500.0, skip) == IPv4Address("10.0.0.7")
    assert t.find_free("n", start, end, 3500.0, skip) == IPv4Address("10.0.0.5")  # expired


async def test_writes_under_load_share_a_commit_and_callbacks_wait_for_it(
    store, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from metald.boot.dhcp import lease_store as leases_mod

    ls = LeaseStore(store)
    loop = asyncio.get_running_loop()
    got: list[WriteResult] = []
    exp = time.time() + 600

    def write(i: int) -> None:
        ls.submit(
            LeaseRecord("n", IPv4Address(f"10.0.0.{i}"), f"m{i}", LeaseState.BOUND, exp), got.append
        )

    write(1)
    await ls.drain()
    assert got == [WriteResult.OK]
    if store.is_sqlite:
        # Right after a commit, new writes wait for the interval and then share one commit;
        # none is answered before it.
        monkeypatch.setattr(leases_mod, "COMMIT_INTERVAL", 3600.0)
        ls._last_commit = loop.time()
        commits = ls.commits
        for i in range(2, 6):
            write(i)
        for _ in range(3):
            await asyncio.sleep(0)
        assert got == [WriteResult.OK] and ls.commits == commits
        assert isinstance(ls._inline_handle, asyncio.TimerHandle)
        await ls.drain()  # does not wait out the interval
        assert got == [WriteResult.OK] * 5 and ls.commits == commits + 1
        # A short interval elapses by itself.
        monkeypatch.setattr(leases_mod, "COMMIT_INTERVAL", 0.01)
        ls._last_commit = loop.time()
        write(9)
        for _ in range(500):
            if len(got) == 6:
                break
            await asyncio.sleep(0.01)
        assert got == [WriteResult.OK] * 6 and ls.commits == commits + 2
        # Idle for longer than the interval: the next write commits on the next loop pass.
        ls._last_commit = loop.time() - 1
        write(10)
        assert not isinstance(ls._inline_handle, asyncio.TimerHandle)
    await ls.drain()
    fresh = LeaseStore(store)
    assert await fresh.load() == len(got)
    ls.close()
    fresh.close()


def _count(counter, label: str) -> float:  # type: ignore[no-untyped-def]
    return counter.labels(label)._value.get()


async def test_counters_are_exact_after_each_wakeup(store) -> None:  # type: ignore[no-untyped-def]
    srv, relay, leases = await start(store)
    try:
        before = [
            _count(metrics.dhcp_packets, "discover"),
            _count(metrics.dhcp_packets, "request"),
            _count(metrics.dhcp_replies, "offer"),
            _count(metrics.dhcp_replies, "ack"),
        ]
        for i in range(3):
            ack = await dora(srv, relay, f"52:54:00:00:07:{i:02x}")
            assert ack.message_type is MessageType.ACK
        await asyncio.sleep(0.01)
        after = [
            _count(metrics.dhcp_packets, "discover"),
            _count(metrics.dhcp_packets, "request"),
            _count(metrics.dhcp_replies, "offer"),
            _count(metrics.dhcp_replies, "ack"),
        ]
        assert [a - b for a, b in zip(after, before, strict=True)] == [3, 3, 3, 3]
        assert srv._counts == {}
    finally:
        await srv.stop()
        leases.close()
        relay.close()
