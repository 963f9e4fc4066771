"""The durable lease store: group commit, conflicts between instances, a busy database."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from ipaddress import IPv4Address

from metald.boot.dhcp.lease_store import (
    LeaseRecord,
    LeaseState,
    LeaseStore,
    LeaseTable,
    WriteResult,
)


def rec(ip: str, mac: str, state: LeaseState = LeaseState.BOUND) -> LeaseRecord:
    return LeaseRecord("n", IPv4Address(ip), mac, state, time.time() + 600)


async def test_burst_shares_one_transaction_and_reloads(store) -> None:  # type: ignore[no-untyped-def]
    ls = LeaseStore(store)
    got: list[WriteResult] = []
    for i in range(50):
        ls.submit(rec(f"10.0.0.{i + 1}", f"52:54:00:00:00:{i:02x}"), got.append)
    await ls.drain()
    assert got == [WriteResult.OK] * 50 and ls.commits == 1
    fresh = LeaseStore(store)
    assert await fresh.load() == 50
    assert fresh.table.for_mac("n", "52:54:00:00:00:07").ip == IPv4Address("10.0.0.8")
    ls.close()
    fresh.close()


async def test_an_address_held_by_another_instance_is_a_conflict(store) -> None:  # type: ignore[no-untyped-def]
    a, b = LeaseStore(store), LeaseStore(store)
    got: list[WriteResult] = []
    a.submit(rec("10.0.0.1", "aa:aa:aa:aa:aa:01"), got.append)
    await a.drain()
    b.submit(rec("10.0.0.1", "bb:bb:bb:bb:bb:02"), got.append)
    b.submit(rec("10.0.0.2", "bb:bb:bb:bb:bb:03"), got.append)
    await b.drain()
    assert got == [WriteResult.OK, WriteResult.CONFLICT, WriteResult.OK]
    # Once released, the address may be taken over.
    a.submit(rec("10.0.0.1", "aa:aa:aa:aa:aa:01", LeaseState.RELEASED), got.append)
    await a.drain()
    b.submit(rec("10.0.0.1", "bb:bb:bb:bb:bb:02"), got.append)
    await b.drain()
    assert got[-2:] == [WriteResult.OK, WriteResult.OK]
    a.close()
    b.close()


async def test_busy_database_is_waited_for_off_the_loop(sqlite_store) -> None:  # type: ignore[no-untyped-def]
    store = sqlite_store
    ls = LeaseStore(store)
    other = sqlite3.connect(store.engine.url.database, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another writer (the API, another instance) holds it
    got: list[WriteResult] = []
    ls.submit(rec("10.0.0.1", "aa:aa:aa:aa:aa:01"), got.append)
    ticks = 0
    for _ in range(20):
        await asyncio.sleep(0.01)
        ticks += 1
    assert got == [] and ticks == 20  # not written, and the loop kept running meanwhile
    other.execute("ROLLBACK")
    other.close()
    await ls.drain()
    assert got == [WriteResult.OK]
    ls.close()


def test_for_mac_is_only_ever_the_macs_own_record() -> None:
    """A record taken over in place (the server marks an address another instance won with an
    empty MAC) stops being the old MAC's: its index must not hand it back as "its" lease."""
    t = LeaseTable()
    rec = LeaseRecord("n", IPv4Address("10.0.0.5"), "52:54:00:00:00:01", LeaseState.BOUND, 9e9)
    t.put(rec)
    assert t.for_mac("n", "52:54:00:00:00:01") is rec
    t.lost(rec, 9e9)  # as DhcpServer._committed does on a lost race
    assert t.for_mac("n", "52:54:00:00:00:01") is None
    assert t.for_mac("n", "") is None


def test_learning_from_the_store_never_frees_what_this_table_holds() -> None:
    """A row read from the store (another instance wrote it) replaces this table's record,
    except that a stored "free" never overwrites an address this table holds: its offers are
    never stored and its bindings may not have committed yet."""
    t = LeaseTable()
    ip = IPv4Address("10.0.0.5")
    offer = LeaseRecord("n", ip, "52:54:00:00:00:01", LeaseState.OFFERED, 1030.0)
    t.put(offer)
    t.learn(LeaseRecord("n", ip, "52:54:00:00:00:02", LeaseState.RELEASED, 900.0), 1000.0)
    assert t.get("n", ip) is offer
    theirs = LeaseRecord("n", ip, "52:54:00:00:00:02", LeaseState.BOUND, 1600.0)
    t.learn(theirs, 1000.0)
    assert t.get("n", ip) is theirs and t.for_mac("n", "52:54:00:00:00:01") is None
    # Once this table's hold is over, the store's word is taken as it is.
    t.learn(LeaseRecord("n", ip, "52:54:00:00:00:02", LeaseState.RELEASED, 1700.0), 1700.0)
    assert t.get("n", ip).state is LeaseState.RELEASED
