"""Pooled PostgreSQL connections are tested before use only when they sat idle
(``metald.store.db.PING_IDLE_S``): a storm's transactions reuse connections that answered
moments before and pay no round-trip first (SQLAlchemy's ``pool_pre_ping`` tested every
checkout), while a connection that broke while idle is still replaced before any call sees it.
Real PostgreSQL (the session's server); a backend is ended with ``pg_terminate_backend``, as a
restart ends them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy import exc as sa_exc

from metald.store import db as store_db
from metald.store.db import Store, store_unavailable
from vmlab.pg import PgServer


@pytest.fixture
def pg_store(pg_server: PgServer) -> Iterator[Store]:
    url = pg_server.new_database(template=pg_server.migrated_template())
    store = Store(url)
    try:
        yield store
    finally:
        store.close()
        pg_server.drop_database(url)


def _count_pings(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    pings = [0]
    real = store.engine.dialect.do_ping

    def counted(dbapi_conn: Any) -> bool:
        pings[0] += 1
        return real(dbapi_conn)

    monkeypatch.setattr(store.engine.dialect, "do_ping", counted)
    return pings


def _pid(store: Store) -> int:
    with store.session() as s:
        return int(s.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _terminate(pg_server: PgServer, store: Store, pid: int) -> None:
    other = create_engine(str(store.engine.url))
    try:
        with other.connect() as c:
            assert c.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
    finally:
        other.dispose()


def test_a_connection_used_moments_ago_is_not_tested_again(
    pg_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    pings = _count_pings(pg_store, monkeypatch)
    pids = {_pid(pg_store) for _ in range(20)}
    # One connection, reused at once: at most its first checkout is tested (the old engine,
    # pool_pre_ping, tested all 20).
    assert len(pids) == 1
    assert pings[0] <= 1


def test_an_idle_connection_that_broke_is_replaced_before_any_call_sees_it(
    pg_server: PgServer, pg_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_db, "PING_IDLE_S", 0.05)
    pings = _count_pings(pg_store, monkeypatch)
    first = _pid(pg_store)
    _terminate(pg_server, pg_store, first)  # as a restart would, while the pool holds it
    time.sleep(0.1)  # idle for longer than PING_IDLE_S
    # Fails without any test before use: the call would get the dead connection.
    second = _pid(pg_store)
    assert second != first
    assert pings[0] >= 2


def test_a_connection_that_broke_within_the_idle_time_fails_one_call_as_unavailable(
    pg_server: PgServer, pg_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the idle time gives up, pinned: a connection that broke since it was used moments
    ago fails the call that gets it, as "store unavailable" (503 with Retry-After in the
    API), and the next call gets a fresh connection."""
    monkeypatch.setattr(store_db, "PING_IDLE_S", 3600.0)
    first = _pid(pg_store)
    _terminate(pg_server, pg_store, first)
    with pytest.raises(sa_exc.DBAPIError) as ei:
        _pid(pg_store)
    assert store_unavailable(ei.value)
    assert _pid(pg_store) != first
