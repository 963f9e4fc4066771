"""DHCP leases: an in-memory table the decision core reads, made durable in the ``leases`` table.

The table (``LeaseTable``) is pure and answers "which address may this client have" in
microseconds. ``LeaseStore`` writes changes to the database with group commit: writes that
arrive while a transaction is in flight are batched into the next one, and a write's callback
runs only after its transaction committed, so the server sends an ACK only for a lease that is
on disk (SQLite WAL with synchronous=NORMAL survives kill -9).

Several metald instances may share one database. The row for (network, ip) is unique and a
write takes it over only if it is ours already, expired, released or declined (one upsert with a
WHERE); a write that loses that race reports a conflict and the server answers NAK.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from ipaddress import IPv4Address
from socket import inet_ntoa
from typing import Any

from sqlalchemy import bindparam, or_, select
from sqlmodel import Session
from sqlmodel import select as sm_select

from metald.store.db import Store
from metald.store.models import Lease, as_utc

log = logging.getLogger(__name__)


#: Most lease writes in one transaction.
MAX_BATCH = 500
#: Least time between WAL checkpoints of the lease writer.
CHECKPOINT_SECONDS = 1.0
#: Least time between two lease commits. A commit has a fixed cost (~70 us: BEGIN IMMEDIATE's
#: locks, the WAL append) whatever its size; under load, writes that arrive within this window
#: of the last commit wait for it and share the next transaction. An idle server commits at
#: once. ACKs still leave only after their commit.
COMMIT_INTERVAL = 0.002


class LeaseState(StrEnum):
    OFFERED = "offered"  # in memory only: an offer is a promise, not a handout
    BOUND = "bound"
    RELEASED = "released"
    DECLINED = "declined"  # someone else answers ARP for it; quarantined until expires_at


class WriteResult(StrEnum):
    OK = "ok"
    CONFLICT = "conflict"  # another instance holds the address
    ERROR = "error"  # the database failed; nothing was promised


@dataclass(slots=True)  # no per-instance __dict__: one object less per packet for the GC
class LeaseRecord:
    network: str
    ip: IPv4Address
    mac: str
    state: LeaseState
    #: Unix time.
    expires_at: float
    client_id: str | None = None
    hostname: str | None = None

    def holds(self, now: float) -> bool:
        """Whether the address is unavailable to other clients at ``now``."""
        if self.state in (LeaseState.BOUND, LeaseState.OFFERED, LeaseState.DECLINED):
            return self.expires_at > now
        return False


class LeaseTable:
    """Per network: address -> record and MAC -> address. Pure; the caller passes the time.

    Keyed inside by the address as an int: IPv4Address hashes in Python (hash(hex(int))), and
    the hot path does several lookups per packet."""

    def __init__(self) -> None:
        self._by_ip: dict[str, dict[int, LeaseRecord]] = {}
        self._by_mac: dict[str, dict[str, IPv4Address]] = {}
        self._cursor: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_ip.values())

    def records(self) -> Iterator[LeaseRecord]:
        for by_ip in self._by_ip.values():
            yield from by_ip.values()

    def get(self, network: str, ip: IPv4Address) -> LeaseRecord | None:
        by_ip = self._by_ip.get(network)
        return None if by_ip is None else by_ip.get(int(ip))

    def for_mac(self, network: str, mac: str) -> LeaseRecord | None:
        """The MAC's current record (its offer or binding): the last one put for it."""
        by_mac = self._by_mac.get(network)
        ip = None if by_mac is None else by_mac.get(mac)
        if ip is None:
            return None
        rec = self._by_ip[network].get(int(ip))
        # A record taken over in place (another instance holds the address) is not the MAC's.
        return rec if rec is not None and rec.mac == mac else None

    def put(self, rec: LeaseRecord) -> None:
        by_ip = self._by_ip.get(rec.network)
        if by_ip is None:
            by_ip = self._by_ip[rec.network] = {}
            self._by_mac[rec.network] = {}
        by_mac = self._by_mac[rec.network]
        key = int(rec.ip)
        old = by_ip.get(key)
        if old is not None and old.mac != rec.mac and by_mac.get(old.mac) == rec.ip:
            del by_mac[old.mac]
        by_ip[key] = rec
        if rec.mac:
            by_mac[rec.mac] = rec.ip

    def available_to(self, network: str, ip: IPv4Address, mac: str, now: float) -> bool:
        rec = self.get(network, ip)
        return (
            rec is None or rec.mac == mac and rec.state != LeaseState.DECLINED or not rec.holds(now)
        )

    def find_free(
        self,
        network: str,
        start: IPv4Address,
        end: IPv4Address,
        now: float,
        skip: frozenset[IPv4Address] = frozenset(),
    ) -> IPv4Address | None:
        """Next address in [start, end] nobody holds, continuing where the last search
        stopped so a burst of new clients does not rescan the same held addresses."""
        lo, hi = int(start), int(end)
        size = hi - lo + 1
        cur = self._cursor.get(network, 0) % size
        by_ip = self._by_ip.get(network, {})
        for i in range(size):
            off = (cur + i) % size
            rec = by_ip.get(lo + off)
            # Prefer never-used addresses; a released/expired one may still be reused.
            if rec is None or not rec.holds(now):
                ip = IPv4Address(lo + off)
                if skip and ip in skip:
                    continue
                self._cursor[network] = off + 1
                return ip
        return None


def _to_dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _from_dt(dt: datetime) -> float:
    return as_utc(dt).timestamp()


class LeaseStore:
    """The table plus durable, group-committed writes to the ``leases`` table."""

    def __init__(self, store: Store, *, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.table = LeaseTable()
        self.clock = clock
        self._pending: list[tuple[LeaseRecord, Callable[[WriteResult], None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._sqlite_path = _sqlite_path(store)
        self._conn: sqlite3.Connection | None = None
        # Used only when the database is busy (another writer holds it) and for checkpoints.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leases")
        self._checkpoint_conn: sqlite3.Connection | None = None
        self._checkpointing = False
        self._last_checkpoint = 0.0
        self._inline_scheduled = False
        self._inline_handle: asyncio.Handle | None = None
        self._last_commit = -1e9
        self._busy_timeout: int | None = None
        #: Transactions and rows written, for the benchmark and tests.
        self.commits = 0
        self.rows_written = 0

    async def load(self) -> int:
        rows = await self.store.run(lambda s: list(s.exec(sm_select(Lease)).all()))
        # Oldest write first, so a MAC's current record is its last one, as before the restart
        # (a MAC may have older released rows; a binding wins a tie with them).
        rows.sort(key=lambda r: (as_utc(r.updated_at), r.state == LeaseState.BOUND.value))
        for row in rows:
            self.table.put(
                LeaseRecord(
                    network=row.network,
                    ip=IPv4Address(row.ip),
                    mac=row.mac,
                    state=LeaseState(row.state),
                    expires_at=_from_dt(row.expires_at),
                    client_id=row.client_id,
                    hostname=row.hostname,
                )
            )
        return len(rows)

    def submit(self, rec: LeaseRecord, done: Callable[[WriteResult], None]) -> None:
        """Queue a durable write; ``done`` runs on the loop once it committed (or failed).

        Writes queued before the loop next runs its ready callbacks (a whole burst of
        packets read in one wake-up) share one transaction."""
        self._pending.append((rec, done))
        if self._flusher is None or self._flusher.done():
            if self._sqlite_path is not None and not self._inline_scheduled:
                # A plain callback, not a task: cheaper, and it runs after the current burst
                # (or, under load, COMMIT_INTERVAL after the last commit).
                self._inline_scheduled = True
                loop = asyncio.get_running_loop()
                wait = self._last_commit + COMMIT_INTERVAL - loop.time()
                self._inline_handle = (
                    loop.call_later(wait, self._flush_inline)
                    if wait > 0
                    else loop.call_soon(self._flush_inline)
                )
            elif self._sqlite_path is None:
                self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    def _flush_inline(self) -> None:
        self._inline_scheduled, self._inline_handle = False, None
        loop = asyncio.get_running_loop()
        while self._pending and (self._flusher is None or self._flusher.done()):
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            recs = [r for r, _ in batch]
            rows = _sqlite_rows(recs, self.clock())
            try:
                results = self._write_sqlite(recs, rows, wait=False)
            except sqlite3.OperationalError as e:
                if not _is_busy(e):
                    log.exception("lease write of %d rows failed", len(batch))
                    self._complete(batch, [WriteResult.ERROR] * len(batch))
                    continue
                # Someone else is writing: this batch and what follows wait off the loop.
                self._pending[:0] = batch
                self._flusher = loop.create_task(self._flush_loop())
                return
            except Exception:
                log.exception("lease write of %d rows failed", len(batch))
                results = [WriteResult.ERROR] * len(batch)
            else:
                self.commits += 1
                self.rows_written += len(batch)
            self._complete(batch, results)
        self._last_commit = loop.time()
        self._maybe_checkpoint(loop)

    def _complete(
        self,
        batch: list[tuple[LeaseRecord, Callable[[WriteResult], None]]],
        results: list[WriteResult],
    ) -> None:
        for (_, done), res in zip(batch, results, strict=True):
            try:
                done(res)
            except Exception:
                log.exception("lease write callback failed")

    async def drain(self) -> None:
        while self._inline_scheduled or (self._flusher is not None and not self._flusher.done()):
            if self._inline_handle is not None:
                # Do not wait out COMMIT_INTERVAL: write now.
                self._inline_handle.cancel()
                self._flush_inline()
                continue
            if self._flusher is not None and not self._flusher.done():
                await asyncio.shield(self._flusher)
            else:
                await asyncio.sleep(0)

    async def _flush_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            # Bounded so the conflict lookup stays under SQLite's bound-parameter limit.
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            recs = [r for r, _ in batch]
            try:
                if self._sqlite_path is not None:
                    # Only after an inline write found the database busy (see _flush_inline):
                    # wait for the other writer off the loop.
                    rows = _sqlite_rows(recs, self.clock())
                    results = await loop.run_in_executor(
                        self._thread, self._write_sqlite, recs, rows, True
                    )
                else:
                    results = await self.store.run(_write_batch, recs, self.clock())
                self.commits += 1
                self.rows_written += len(batch)
            except Exception:
                log.exception("lease write of %d rows failed", len(batch))
                results = [WriteResult.ERROR] * len(batch)
            self._complete(batch, results)
            await asyncio.sleep(0)  # let packets in before the next batch

    def _connect(self) -> sqlite3.Connection:
        assert self._sqlite_path is not None
        conn = sqlite3.connect(self._sqlite_path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL survives a killed process; only power loss can lose the last commits.
        conn.execute("PRAGMA synchronous=NORMAL")
        # Checkpoints (which fsync) run on the lease thread, never inside an ACK's commit.
        conn.execute("PRAGMA wal_autocheckpoint=0")
        return conn

    def _write_sqlite(
        self, recs: list[LeaseRecord], rows: list[tuple[Any, ...]], wait: bool
    ) -> list[WriteResult]:
        if self._conn is None:
            self._conn = self._connect()
        conn = self._conn
        # SQLite on the loop itself (wait=False): a batch commits in ~0.1-0.7 ms, while a
        # hand-off to a thread re-takes the GIL once per row and waited up to the 5 ms switch
        # interval each time (50 ms average ACK delay seen at 1000/s).
        timeout = 30000 if wait else 0
        if timeout != self._busy_timeout:
            conn.execute(f"PRAGMA busy_timeout={timeout}")
            self._busy_timeout = timeout
        conn.execute("BEGIN IMMEDIATE")
        try:
            cur = conn.executemany(_SQLITE_UPSERT, rows)
            results = [WriteResult.OK] * len(recs)
            if cur.rowcount != len(recs):
                marks = ",".join("?" * len(recs))
                owners = {
                    (n, ip): mac
                    for n, ip, mac in conn.execute(
                        f"SELECT network, ip, mac FROM leases WHERE ip IN ({marks})",
                        [str(r.ip) for r in recs],
                    )
                }
                results = [
                    WriteResult.OK
                    if owners.get((r.network, str(r.ip))) == r.mac
                    else WriteResult.CONFLICT
                    for r in recs
                ]
            conn.execute("COMMIT")
            return results
        except BaseException:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                conn.close()
                self._conn, self._busy_timeout = None, None
            raise

    def _maybe_checkpoint(self, loop: asyncio.AbstractEventLoop) -> None:
        now = time.monotonic()
        if self._checkpointing or now - self._last_checkpoint < CHECKPOINT_SECONDS:
            return
        self._checkpointing, self._last_checkpoint = True, now
        fut = loop.run_in_executor(self._thread, self._checkpoint)
        fut.add_done_callback(lambda _f: setattr(self, "_checkpointing", False))

    def _checkpoint(self) -> None:
        # PASSIVE: copies what it can without blocking writers; the WAL is reused after.
        try:
            if self._checkpoint_conn is None:
                self._checkpoint_conn = self._connect()
            self._checkpoint_conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as e:
            log.warning("lease WAL checkpoint: %s", e)

    def close(self) -> None:
        def close_all() -> None:
            for c in (self._conn, self._checkpoint_conn):
                if c is not None:
                    c.close()
            self._conn = self._checkpoint_conn = None

        self._thread.submit(close_all).result()
        self._thread.shutdown(wait=True)


def _sqlite_path(store: Store) -> str | None:
    if not store.is_sqlite:
        return None
    db = store.engine.url.database
    return db if db and db != ":memory:" else None


def _is_busy(e: sqlite3.OperationalError) -> bool:
    msg = str(e).lower()
    return "locked" in msg or "busy" in msg


def _sqlite_rows(recs: list[LeaseRecord], now: float) -> list[tuple[Any, ...]]:
    now_s = _sqlite_ts(now)
    return [
        (
            r.network,
            inet_ntoa(r.ip.packed),
            r.mac,
            r.client_id,
            r.hostname,
            r.state.value,
            _sqlite_ts(r.expires_at),
            now_s,
            now_s,
        )
        for r in recs
    ]


def _upsert_stmt(dialect: str):  # type: ignore[no-untyped-def]
    t = Lease.__table__  # type: ignore[attr-defined]
    if dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        from sqlalchemy.dialects.postgresql import insert
    ins = insert(t)
    ex = ins.excluded
    return ins.on_conflict_do_update(
        index_elements=[t.c.network, t.c.ip],
        set_={
            "mac": ex.mac,
            "client_id": ex.client_id,
            "hostname": ex.hostname,
            "state": ex.state,
            "expires_at": ex.expires_at,
            "updated_at": ex.updated_at,
        },
        # Take the row over only if it is ours, or nobody holds it any more.
        where=or_(
            t.c.mac == ex.mac,
            t.c.expires_at < bindparam("now_dt"),
            # Two equalities, not IN: an expanding IN cannot be used with executemany.
            t.c.state == bindparam("released", LeaseState.RELEASED.value),
            t.c.state == bindparam("declined", LeaseState.DECLINED.value),
        ),
    )


_STMTS: dict[str, object] = {}


#: The same upsert as ``_upsert_stmt`` in SQLite's own dialect, for the hot path: executemany
#: of plain tuples costs ~5 us a row against ~30 us through SQLAlchemy's per-row type handling.
_SQLITE_UPSERT = (
    "INSERT INTO leases (network, ip, mac, client_id, hostname, state, expires_at, updated_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (network, ip) DO UPDATE SET mac = excluded.mac,"
    " client_id = excluded.client_id, hostname = excluded.hostname, state = excluded.state,"
    " expires_at = excluded.expires_at, updated_at = excluded.updated_at"
    " WHERE leases.mac = excluded.mac OR leases.expires_at < ?"
    " OR leases.state IN ('released', 'declined')"
)


#: Whole second -> "YYYY-mm-dd HH:MM:SS" (UTC): strftime costs ~6 us, a lookup ~0.1 us. Bounded.
_TS_SECONDS: dict[int, str] = {}


def _sqlite_ts(ts: float) -> str:
    """A timestamp exactly as SQLAlchemy's SQLite DateTime stores it (UTC, no zone), so
    rows written here read back as datetimes and compare correctly as text.

    Same result as ``datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")``
    (microseconds rounded half-even, as datetime does), with the seconds part cached."""
    if ts < 0:
        return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    sec = int(ts)
    us = round((ts - sec) * 1e6)
    if us >= 1_000_000:
        sec, us = sec + 1, us - 1_000_000
    head = _TS_SECONDS.get(sec)
    if head is None:
        if len(_TS_SECONDS) >= 4096:
            _TS_SECONDS.clear()
        head = _TS_SECONDS[sec] = datetime.fromtimestamp(sec, UTC).strftime("%Y-%m-%d %H:%M:%S")
    return f"{head}.{us:06d}"


def _write_batch(session: Session, recs: list[LeaseRecord], now: float) -> list[WriteResult]:
    """One transaction for the whole batch (PostgreSQL; SQLite takes ``_write_sqlite``).
    Returns per-record results."""
    conn = session.connection()
    dialect = conn.dialect.name
    stmt = _STMTS.get(dialect)
    if stmt is None:
        stmt = _STMTS[dialect] = _upsert_stmt(dialect)
    now_dt = _to_dt(now)
    params = [
        {
            "network": r.network,
            "ip": str(r.ip),
            "mac": r.mac,
            "client_id": r.client_id,
            "hostname": r.hostname,
            "state": r.state.value,
            "expires_at": _to_dt(r.expires_at),
            "updated_at": now_dt,
            "now_dt": now_dt,
            "released": LeaseState.RELEASED.value,
            "declined": LeaseState.DECLINED.value,
        }
        for r in recs
    ]
    res = conn.execute(stmt, params)  # type: ignore[arg-type]
    return _finish(session, conn, recs, res.rowcount)


def _finish(
    session: Session, conn: Any, recs: list[LeaseRecord], rowcount: int
) -> list[WriteResult]:
    results = [WriteResult.OK] * len(recs)
    if rowcount != len(recs):
        # Some row was held by another client: find out which (rare, so a second query is fine).
        t = Lease.__table__  # type: ignore[attr-defined]
        keys = {(r.network, str(r.ip)) for r in recs}
        owners = {
            (n, ip): mac
            for n, ip, mac in conn.execute(
                select(t.c.network, t.c.ip, t.c.mac).where(t.c.ip.in_([ip for _, ip in keys]))
            )
        }
        results = [
            WriteResult.OK if owners.get((r.network, str(r.ip))) == r.mac else WriteResult.CONFLICT
            for r in recs
        ]
    session.commit()
    return results
