"""Events committed out of id order on PostgreSQL reach every reader.

Event ids come from a sequence at INSERT, transactions commit in another order: T1 takes id 1
and stays open, T2 takes id 2 and commits. A reader that delivered 2 and then asks for "after
2" never sees 1. Each test below holds T1 open on its own connection while T2 commits, lets the
reader read, commits T1, and checks the reader's next read returns T1's event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session

from metald.auth import issue_token
from metald.events import EventBus, Position, position_of, read_events
from metald.machines import add_event
from metald.store import Store
from tests.api_helpers import live_api, until

WAIT = 20.0  # bounds a failing test only


@pytest.fixture
def pg_store(pg_server: Any) -> Iterator[Store]:
    s = Store(pg_server.new_database())
    s.migrate()
    try:
        yield s
    finally:
        s.close()


def _write(store: Store, kind: str) -> Session:
    """An open transaction that has written one event (commit it to publish the event)."""
    s = Session(store.engine)
    add_event(s, kind, "test")
    s.flush()
    return s


def _commit(s: Session) -> None:
    s.commit()
    s.close()


def test_a_late_commit_is_read_after_an_earlier_one(pg_store: Store) -> None:
    """The store read itself: a cursor never passes an event that can still commit."""
    with pg_store.session() as s:
        _, cursor = read_events(s, (0, 0), 100)
    t1 = _write(pg_store, "test.t1")  # the smaller id, still open
    t2 = _write(pg_store, "test.t2")
    _commit(t2)
    with pg_store.session() as s:
        first, cursor = read_events(s, cursor, 100)
    _commit(t1)
    with pg_store.session() as s:
        second, cursor = read_events(s, cursor, 100)
    kinds = [e.kind for e in first + second]
    assert sorted(kinds) == ["test.t1", "test.t2"], kinds
    # Delivered once each, and nothing more to read.
    with pg_store.session() as s:
        assert read_events(s, cursor, 100)[0] == []


async def test_the_poller_delivers_an_event_that_commits_late(pg_store: Store) -> None:
    with pg_store.session() as s:
        token, _ = issue_token(s, name="reader", role="technician")
        token_id = token.id
    bus = EventBus(poll_s=0.02)
    bus.bind(pg_store)
    sub = bus.subscribe(token_id)
    got: list[str] = []
    covered: Position | None = None

    async def drain() -> None:
        nonlocal covered
        while (b := await sub.next(0)) is not None:
            if covered is not None:
                assert b.since <= covered, "the poller skipped a range"
            covered = b.until
            got.extend(e.kind for e in b.events)

    try:
        await until(lambda: bus.polls >= 1, "the poller's first read")
        t1 = _write(pg_store, "test.t1")
        t2 = _write(pg_store, "test.t2")
        _commit(t2)
        polls = bus.polls
        bus.notify()
        # Two reads that both began after T2's commit.
        await until(lambda: bus.polls >= polls + 2, "the poller to read T2's commit")
        await drain()
        _commit(t1)
        polls = bus.polls
        bus.notify()
        await until(lambda: bus.polls >= polls + 2, "the poller to read T1's commit")
        await drain()
        assert sub.closed is None, sub.closed
        assert sorted(got) == ["test.t1", "test.t2"], got
    finally:
        bus.unsubscribe(sub)
        await bus.close()


async def test_paging_with_after_returns_an_event_that_commits_late(
    aiohttp_client: Any, pg_store: Store, tmp_path: Path
) -> None:
    """GET /api/v1/events?after=<next_after>: the page after a late commit holds it."""
    live = await live_api(aiohttp_client, pg_store, tmp_path)
    hdr = live.tokens.header("technician")

    async def page(after: int, kind: str = "") -> dict[str, Any]:
        q = f"after={after}" + (f"&kind={kind}" if kind else "")
        r = await live.client.get(f"/api/v1/events?{q}", headers=hdr)
        assert r.status == 200, await r.text()
        return await r.json()

    start = (await page(0))["next_after"]
    t1 = _write(pg_store, "test.t1")
    t2 = _write(pg_store, "test.t2")
    _commit(t2)
    first, first_t2 = await page(start), await page(start, "test.t2")
    _commit(t1)
    second = await page(first["next_after"])
    got = [e["kind"] for e in first["items"] + second["items"]]
    assert sorted(got) == ["test.t1", "test.t2"], got
    # A filtered reader's cursor does not pass T1 either.
    second_t1 = await page(first_t2["next_after"], "test.t1")
    assert [e["kind"] for e in second_t1["items"]] == ["test.t1"]


async def test_a_stream_delivers_an_event_that_commits_late(
    aiohttp_client: Any, pg_store: Store, tmp_path: Path
) -> None:
    """The SSE stream (catch-up and poller batches together)."""
    import json

    live = await live_api(aiohttp_client, pg_store, tmp_path, bus=EventBus(poll_s=0.02))
    start = (
        await (
            await live.client.get(
                "/api/v1/events?sort=-id&limit=1", headers=live.tokens.header("admin")
            )
        ).json()
    )["next_after"]
    stream = await live.client.get(
        f"/api/v1/events/stream?after={start}", headers=live.tokens.header("technician")
    )
    assert stream.status == 200
    t1 = _write(pg_store, "test.t1")
    t2 = _write(pg_store, "test.t2")
    _commit(t2)
    polls = live.ctx.bus.polls
    live.ctx.bus.notify()
    await until(lambda: live.ctx.bus.polls >= polls + 2, "the poller to read T2's commit")
    _commit(t1)
    live.ctx.bus.notify()

    async def kinds() -> list[str]:
        out: list[str] = []
        while len(out) < 2:
            line = (await stream.content.readline()).decode()
            if line.startswith("data:"):
                out.append(json.loads(line[5:])["kind"])
        return out

    got = await asyncio.wait_for(kinds(), WAIT)
    assert sorted(got) == ["test.t1", "test.t2"]
    stream.close()


def test_events_written_before_the_migration_are_read(pg_server: Any) -> None:
    """The expand-only migration: rows written by an older metald get a txid from the
    column's default, and the readers deliver them, then the new ones, each once."""
    from metald.store.db import upgrade

    store = Store(pg_server.new_database())
    try:
        upgrade(store.engine, "0020")
        with store.engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO events (at, kind, actor) VALUES (now(), 'test.old', 'test')"
            )
        store.migrate()
        with store.session() as s:
            add_event(s, "test.new", "test")
            s.commit()
        with store.session() as s:
            rows, cursor = read_events(s, (0, 0), 100)
            assert [e.kind for e in rows] == ["test.old", "test.new"]
            assert all(e.txid is not None for e in rows)
            assert read_events(s, cursor, 100)[0] == []
            # A pre-upgrade client's cursor (the old event's id) resumes after it exactly.
            assert [e.kind for e in read_events(s, position_of(s, rows[0].id or 0), 100)[0]] == [
                "test.new"
            ]
    finally:
        store.close()
