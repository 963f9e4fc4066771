"""The engine and the Store handle the daemon passes around.

SQLite is the embedded default: WAL mode, a busy timeout, foreign keys on, and write
transactions opened with ``BEGIN IMMEDIATE`` so two writers queue instead of failing on a
read-to-write upgrade. PostgreSQL is used by URL for several metald instances sharing one
database. Blocking database work runs in a thread pool so the asyncio loop never waits on I/O.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlmodel import Session

T = TypeVar("T")

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
#: Execution option of Store.read's engine: the transaction only reads.
READ_ONLY = "metald_read_only"


def make_engine(
    url: str, *, echo: bool = False, pool_size: int = 10, max_overflow: int = 20
) -> Engine:
    """The engine for ``url``; ``pool_size``/``max_overflow`` apply to PostgreSQL (SQLite's
    pool is fixed: one writer at a time anyway)."""
    u = make_url(url)
    if u.drivername.startswith("sqlite"):
        if u.database and u.database != ":memory:":
            Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            echo=echo,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=8,
            max_overflow=8,
        )

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _rec: Any) -> None:
            # Autocommit at the driver level: we issue BEGIN ourselves (below).
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL survives a killed process (only power loss can drop the last commits).
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Any) -> None:
            # Store.read's transactions only read: deferred, so they take no write lock.
            read_only = conn.get_execution_options().get(READ_ONLY)
            conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

        return engine
    if u.drivername == "postgresql":
        u = u.set(drivername="postgresql+psycopg")
    # A cut link must fail calls in seconds, not after TCP's minutes: instances fence themselves
    # when their heartbeat cannot be written (metald.fleet.membership).
    engine = create_engine(
        u,
        echo=echo,
        pool_size=pool_size,
        max_overflow=max_overflow,
        connect_args={
            "connect_timeout": 5,
            "keepalives": 1,
            "keepalives_idle": 5,
            "keepalives_interval": 2,
            "keepalives_count": 3,
            "tcp_user_timeout": 10000,
        },
    )
    ping_when_idle(engine)
    return engine


#: A pooled connection unused for this long is tested (a round-trip) before it is handed out;
#: one checked in more recently is not. SQLAlchemy's ``pool_pre_ping`` tests every checkout:
#: under a storm every transaction paid a round-trip first (17 % of the store threads'
#: samples at 3,000 machines; bench/store_ping_cost.py, bench/FLEET.md), though its connection had answered moments
#: before. A connection that broke since its last use (PostgreSQL restarted or failed over
#: within this time) fails its statement as a disconnect instead: SQLAlchemy then invalidates
#: the pool, the call is "store unavailable" (503 with Retry-After, a loop's next round), and
#: the next call opens fresh connections. HikariCP skips its test likewise for a connection
#: used within 500 ms (``aliveBypassWindowMs``).
PING_IDLE_S = 0.5


def ping_when_idle(engine: Engine) -> None:
    """Test a pooled connection before use only when it sat idle for ``PING_IDLE_S``
    (SQLAlchemy's pessimistic disconnect handling, its ``checkout`` recipe): a failed test
    raises ``DisconnectionError``, and the pool replaces the connection and tries again."""

    @event.listens_for(engine, "checkin")
    def _checkin(dbapi_conn: Any, record: Any) -> None:
        record.info["metald_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        since = record.info.get("metald_idle_since")
        if since is not None and time.monotonic() - since < PING_IDLE_S:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as e:
            raise sa_exc.DisconnectionError(f"a pooled connection failed its test: {e}") from e


def libpq_conninfo(engine: Engine) -> str:
    """A libpq connection string for ``engine``'s PostgreSQL, for a connection of its own (the
    lease feed's LISTEN). Built by the dialect, as the engine's own connections are, so a
    multi-host URL (``?host=a:5432&host=b:5432&target_session_attrs=read-write``, Patroni's
    primary and standby: docs/fleet.md) becomes libpq's ``host=a,b port=5432,5432`` and
    reaches the same primary the engine does."""
    _, kwargs = engine.dialect.create_connect_args(engine.url)
    kwargs.pop("context", None)  # psycopg's adapters, not a libpq option
    return psycopg.conninfo.make_conninfo(**{k: v for k, v in kwargs.items() if v is not None})


#: PostgreSQL SQLSTATEs that mean "the server is going away or not there yet", not a
#: statement's own error: admin_shutdown, crash_shutdown, cannot_connect_now (starting up).
_UNAVAILABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03"})


def store_unavailable(e: BaseException) -> bool:
    """Whether ``e`` means the database could not be reached (refused, lost, timed out, shutting
    down or starting up), as opposed to an error of the statement itself. Such a call may be
    retried once the database is back: the API answers 503 with Retry-After for it.

    A failed connection is invalidated by SQLAlchemy (and every pooled connection older than
    it), and a pooled connection idle for ``PING_IDLE_S`` is tested before use, so the next
    call after PostgreSQL comes back opens fresh connections: no restart of metald is needed."""
    if isinstance(e, (sa_exc.DisconnectionError, sa_exc.TimeoutError)):
        return True  # DisconnectionError: pre-ping failed; TimeoutError: the pool's wait
    if isinstance(e, sa_exc.DBAPIError):
        if e.connection_invalidated:
            return True
        e = e.orig  # type: ignore[assignment]
    if isinstance(e, (psycopg.OperationalError, psycopg.InterfaceError)):
        state = getattr(e, "sqlstate", None)
        # No SQLSTATE: the error came from the connection, not from the server's answer.
        return state is None or state.startswith("08") or state in _UNAVAILABLE_SQLSTATES
    return False


class Store:
    """Owns the engine and the thread pool that database calls run on, and the lanes of their
    own (``lane``: the heartbeat, the BMCs' ownership): one thread and one connection each,
    that request work cannot starve."""

    def __init__(self, url: str, *, workers: int = 0) -> None:
        self.url = url
        self.engine = make_engine(url)
        self.is_sqlite = self.engine.dialect.name == "sqlite"
        if workers <= 0:
            # SQLite has one writer at a time and every session here begins as a writer, so a
            # second thread would only wait on its lock and contend for the GIL.
            workers = 1 if self.is_sqlite else 8
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="store")
        # ``read_aside``'s lane: a token lookup or an agent's question never waits in the queue
        # of writes (SQLite's WAL lets readers run beside the one writer; two threads, as they
        # share the GIL with it; PostgreSQL: as many as the writes have).
        readers = 2 if self.is_sqlite else workers
        self._read_pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="store-read")
        self._reader = self.engine.execution_options(
            **{READ_ONLY: True}, **({} if self.is_sqlite else {"postgresql_readonly": True})
        )
        # Lanes of their own (``lane``: the heartbeat's, the BMCs' ownership), opened at
        # their first use (most Stores never heartbeat).
        self._lanes: dict[str, tuple[ThreadPoolExecutor, Engine]] = {}

    @contextmanager
    def session(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as s:
            yield s

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(session, *args, **kwargs)`` in the pool with a fresh session."""

        def call() -> T:
            with self.session() as s:
                return fn(s, *args, **kwargs)

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(call))

    async def read(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Like ``run``, in a read-only transaction (SQLite: deferred, no write lock;
        PostgreSQL: READ ONLY). For reads that many clients repeat, such as event streams."""
        return await self._read(self._pool, fn, *args, **kwargs)

    async def read_aside(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Like ``read``, on a lane of its own: it does not queue behind the writes, and sees
        what is committed when it runs (not the writes still queued before it, which ``read``
        on SQLite's one thread would wait for). For the short reads every request makes: an
        API token's lookup, an agent's question."""
        return await self._read(self._read_pool, fn, *args, **kwargs)

    async def _read(
        self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        def call() -> T:
            with Session(self._reader, expire_on_commit=False) as s:
                return fn(s, *args, **kwargs)

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, functools.partial(call))

    async def heartbeat(
        self, fn: Callable[..., T], *args: Any, timeout_s: float, **kwargs: Any
    ) -> T:
        """Like ``run``, on the heartbeat's own thread and (PostgreSQL) its own connection, so
        a storm that fills ``run``'s pool and the engine's connections cannot delay it: an
        instance must not fence itself because its own request work queued ahead of its
        heartbeat. Each statement is bounded by ``timeout_s`` (PostgreSQL's
        ``statement_timeout`` and ``lock_timeout``): a heartbeat stuck behind a lock fails and
        the next one is tried, instead of holding the lane. SQLite (one instance, one writer)
        shares the main engine; only the thread is the heartbeat's."""
        return await self.lane("beat", fn, *args, timeout_s=timeout_s, **kwargs)

    async def lane(
        self, name: str, fn: Callable[..., T], *args: Any, timeout_s: float, **kwargs: Any
    ) -> T:
        """Like ``run``, on lane ``name``'s own thread and (PostgreSQL) its own connection,
        opened at its first use: the fleet's heartbeat (``"beat"``) and the BMCs' ownership
        (``"own"``: which instance holds which BMC after one dies) never wait in the queue of
        request work, however deep a storm makes it. Statements bounded by ``timeout_s``, as
        ``heartbeat``'s."""
        got = self._lanes.get(name)
        if got is None:
            got = self._lanes[name] = (
                ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"store-{name}"),
                self.engine
                if self.is_sqlite
                else make_engine(self.url, pool_size=1, max_overflow=0),
            )
        pool, engine = got
        ms = max(1, int(timeout_s * 1000))

        def call() -> T:
            with Session(engine, expire_on_commit=False) as s:
                if not self.is_sqlite:
                    # LOCAL: for this transaction only (the connection goes back to the pool).
                    s.execute(text(f"SET LOCAL statement_timeout = {ms}"))
                    s.execute(text(f"SET LOCAL lock_timeout = {ms}"))
                return fn(s, *args, **kwargs)

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, functools.partial(call))

    def migrate(self, revision: str = "head") -> None:
        upgrade(self.engine, revision)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._read_pool.shutdown(wait=True)
        for pool, engine in self._lanes.values():
            pool.shutdown(wait=True)
            if engine is not self.engine:
                engine.dispose()
        self.engine.dispose()


def alembic_config(engine: Engine) -> Any:
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["engine"] = engine
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    from alembic import command

    command.upgrade(alembic_config(engine), revision)


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()
