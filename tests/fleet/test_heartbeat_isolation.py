"""The heartbeat and the BMCs' ownership have their own threads and connections: request
work that fills the store's pool (a storm, or statements stuck on a lock) cannot delay the
heartbeat into self-fencing, nor a dead instance's BMCs' takeover. Real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text, update
from sqlmodel import Session

from metald.bmc import ownership
from metald.bmc.executor import BmcExecutor
from metald.config import BmcConfig
from metald.fleet import registry
from metald.fleet.membership import Membership
from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Bmc, Instance, utcnow
from tests.fleet.test_bmc_ownership import View

pytestmark = pytest.mark.postgres

LOCK = 424242
WORKERS = 2


@pytest.fixture
def pg(pg_server) -> Iterator[tuple[Store, str]]:  # type: ignore[no-untyped-def]
    url = pg_server.new_database()
    store = Store(url, workers=WORKERS)
    store.migrate()
    yield store, url
    store.close()


def _blocked(s: Session) -> None:
    """Request work that waits on a lock the test holds: it holds a pool thread meanwhile."""
    s.execute(text("SELECT pg_advisory_lock(:k)"), {"k": LOCK})
    s.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": LOCK})


def _waiting(url: str) -> int:
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql")) as c:
        row = c.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        ).fetchone()
        return int(row[0]) if row else 0


def _heartbeat_at(url: str, name: str) -> object:
    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql")) as c:
        row = c.execute("SELECT heartbeat_at FROM instances WHERE name = %s", (name,)).fetchone()
        assert row is not None
        return row[0]


async def test_a_saturated_store_pool_still_heartbeats_and_does_not_fence(
    pg: tuple[Store, str],
) -> None:
    store, url = pg
    # A long fencing age: only a heartbeat that does not land can fence here, not the clock.
    a = Membership(store, "rack1", heartbeat_s=1.0, dead_after_s=600.0)
    await a.start()
    holder = psycopg.connect(url.replace("postgresql+psycopg", "postgresql"), autocommit=True)
    storm: list[asyncio.Future[None]] = []
    try:
        holder.execute("SELECT pg_advisory_lock(%s)", (LOCK,))
        # More blocked calls than the pool has threads: every worker waits, the rest queue.
        storm = [asyncio.ensure_future(store.run(_blocked)) for _ in range(WORKERS * 3)]
        while await asyncio.to_thread(_waiting, url) < WORKERS:
            await asyncio.sleep(0.05)
        before_db = await asyncio.to_thread(_heartbeat_at, url, "rack1")
        before = a.lease_until()
        # The old heartbeat queued behind the storm in the same pool and never ran while the
        # lock was held: this wait then fails instead of passing.
        await asyncio.wait_for(a.beat_once(), timeout=30)
        assert a.lease_until() > before
        assert not a.fenced
        assert await asyncio.to_thread(_heartbeat_at, url, "rack1") > before_db  # type: ignore[operator]
        assert [m.name for m in a.live()] == ["rack1"]
        assert not any(f.done() for f in storm)  # the storm still holds every worker
    finally:
        holder.execute("SELECT pg_advisory_unlock(%s)", (LOCK,))
        holder.close()
        await asyncio.gather(*storm, return_exceptions=True)
        await a.stop()


async def test_a_heartbeat_stuck_on_a_lock_fails_within_its_statement_timeout(
    pg: tuple[Store, str],
) -> None:
    """The heartbeat's own statement is bounded: a lock on its row (held here by another
    connection) makes it fail, freeing its lane for the next heartbeat, not hang on it."""
    store, url = pg
    a = Membership(store, "rack1", heartbeat_s=0.2, dead_after_s=600.0)
    await a.start()
    # Its own heartbeats (bounded at half of a 592 s fencing age) would hold the lane ahead of
    # the one this test sends: only this one is sent.
    await a.stop_beats()
    holder = psycopg.connect(url.replace("postgresql+psycopg", "postgresql"))
    try:
        holder.execute("SELECT 1 FROM instances WHERE name = 'rack1' FOR UPDATE")
        with pytest.raises(Exception) as e:
            await asyncio.wait_for(
                store.heartbeat(registry.beat, "rack1", a.incarnation, timeout_s=0.2), timeout=30
            )
        assert "timeout" in str(e.value).lower() or "canceling" in str(e.value).lower()
    finally:
        holder.rollback()
        holder.close()
        await a.stop()


async def test_a_saturated_store_pool_still_settles_bmc_ownership(
    pg: tuple[Store, str], tmp_path: Path
) -> None:
    """A dead instance's BMCs are taken over on the ownership's own lane: with every pool
    thread of the store held by request work (a storm's queue), a survivor still reads the
    BMCs and acquires its share. The old settle ran on the pool, queued behind the storm, and
    waited as long as it did (24 s of takeover in a storm: issue 33)."""
    store, url = pg
    for name in ("a", "b"):
        with store.session() as s:
            registry.register(
                s,
                name=name,
                incarnation=name,
                version="t",
                api_url=None,
                host=None,
                serves={},
                dead_after_s=10.0,
            )
    with store.session() as s:
        bmc = Bmc(address="10.1.0.5", protocol="ipmi", username="u", password_enc=b"x")
        s.add(bmc)
        s.commit()
        bid = bmc.id
        assert ownership.acquire(s, "b", [bid], 10.0) == {bid: 1}
        s.execute(
            update(Instance)
            .where(Instance.name == "b")  # type: ignore[arg-type]
            .values(heartbeat_at=utcnow() - timedelta(seconds=60))
        )
        s.commit()  # b died holding it
    control = BmcExecutor(store, SecretBox.from_file(tmp_path / "k"), BmcConfig(), "a")
    control.ownership = View("a", owner="a", dead_after_s=10.0)
    holder = psycopg.connect(url.replace("postgresql+psycopg", "postgresql"), autocommit=True)
    storm: list[asyncio.Future[None]] = []
    try:
        holder.execute("SELECT pg_advisory_lock(%s)", (LOCK,))
        storm = [asyncio.ensure_future(store.run(_blocked)) for _ in range(WORKERS * 3)]
        while await asyncio.to_thread(_waiting, url) < WORKERS:
            await asyncio.sleep(0.05)
        await asyncio.wait_for(control.sync_ownership(), timeout=30)
        assert control.held == {bid: 2}
        assert not any(f.done() for f in storm)  # the storm still holds every worker
    finally:
        holder.execute("SELECT pg_advisory_unlock(%s)", (LOCK,))
        holder.close()
        await asyncio.gather(*storm, return_exceptions=True)
        await control.close()
