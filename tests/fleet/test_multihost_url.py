"""metald on a multi-host PostgreSQL URL (docs/fleet.md, "PostgreSQL failover"): the store and
the lease feed's own LISTEN connection both reach the one server that accepts writes, skip a
host that is down and one that is read-only, and follow when the writable one changes, without
a restart.

Real parts: two private PostgreSQL servers (Debian's binaries) and a port nothing listens on.
A standby is stood in for by a server whose ``default_transaction_read_only`` is on: libpq's
``target_session_attrs=read-write`` reads that setting (and ``in_hot_standby``) the same way,
and a real standby (Patroni's) is the long test's (tests/fleet/test_patroni_failover.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import text

from metald.boot.dhcp.lease_feed import LeaseFeed
from metald.boot.dhcp.lease_store import LeaseStore
from metald.store import Store, libpq_conninfo
from metald.store import db as store_db
from tests.fleet.test_membership import wait_for
from vmlab.labnet import free_port
from vmlab.pg import PgServer, pg_bindir

pytestmark = pytest.mark.postgres

DB = "metald"


def test_conninfo_keeps_every_host_and_the_session_attrs() -> None:
    from sqlalchemy import create_engine

    url = "postgresql+psycopg://pg:pw@/m?host=10.0.0.11:5432&host=10.0.0.12:5433&target_session_attrs=read-write"
    info = psycopg.conninfo.conninfo_to_dict(libpq_conninfo(create_engine(url)))
    assert info["host"] == "10.0.0.11,10.0.0.12"
    assert info["port"] == "5432,5433"
    assert info["target_session_attrs"] == "read-write"
    assert (info["dbname"], info["user"], info["password"]) == ("m", "pg", "pw")


def _admin(pg: PgServer) -> psycopg.Connection:
    return psycopg.connect(
        f"host={pg.dir} port={pg.port} user=metald dbname=postgres", autocommit=True
    )


def _read_only(pg: PgServer, on: bool) -> None:
    with _admin(pg) as c:
        c.execute(f"ALTER SYSTEM SET default_transaction_read_only = {'on' if on else 'off'}")
        c.execute("SELECT pg_reload_conf()")


@pytest.fixture
def two() -> Iterator[tuple[PgServer, PgServer]]:
    if pg_bindir() is None:
        pytest.fail("PostgreSQL is not installed; run scripts/bootstrap (make test does)")
    a = PgServer()
    b: PgServer | None = None
    try:
        b = PgServer()
        for pg in (a, b):
            with _admin(pg) as c:
                c.execute(f'CREATE DATABASE "{DB}"')
        yield a, b
    finally:
        for pg in (a, b):
            if pg is not None:
                # The test stopped one already: its folder is removed all the same.
                with contextlib.suppress(subprocess.CalledProcessError):
                    pg.stop()


def _port(store: Store) -> int:
    with store.session() as s:
        port = s.execute(text("SELECT inet_server_port()")).scalar_one()
        s.execute(text("CREATE TABLE IF NOT EXISTS probe (n int)"))  # a write: primary only
        s.execute(text("INSERT INTO probe VALUES (1)"))
        s.commit()
        return int(port)


async def test_store_and_lease_feed_reach_the_writable_host_and_follow_it(
    two: tuple[PgServer, PgServer],
) -> None:
    standby, primary = two
    _read_only(standby, True)
    dead = free_port()
    hosts = "&".join(f"host=127.0.0.1:{p}" for p in (dead, standby.port, primary.port))
    url = f"postgresql+psycopg://metald@/{DB}?{hosts}&target_session_attrs=read-write"
    store = Store(url)
    feed: LeaseFeed | None = None
    try:
        store.migrate()
        assert _port(store) == primary.port
        feed = LeaseFeed(LeaseStore(store), "i0")
        await feed.start()
        await asyncio.wait_for(feed.connected.wait(), 15)
        assert feed._conn is not None
        assert feed._conn.info.port == primary.port

        # "Failover": the primary is gone, the standby accepts writes.
        primary._run(["pg_ctl", "-D", str(primary.data), "-m", "immediate", "-w", "stop"])
        _read_only(standby, False)
        Store(
            f"postgresql+psycopg://metald@127.0.0.1:{standby.port}/{DB}"
        ).migrate()  # what replication would have carried over
        # The same Store, no restart: pooled connections to the dead server are dropped
        # (tested before use once idle for PING_IDLE_S; a failover takes longer than that,
        # here it is instant) and a new one goes to the host that accepts writes now.
        await asyncio.sleep(store_db.PING_IDLE_S + 0.1)
        assert _port(store) == standby.port
        await wait_for(
            lambda: (
                feed is not None
                and feed.connected.is_set()
                and feed._conn is not None
                and feed._conn.info.port == standby.port
            ),
            timeout=30,
        )
    finally:
        if feed is not None:
            await feed.stop()
        store.close()
