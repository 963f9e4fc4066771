"""DHCP leases made durable in the ``leases`` table.

The in-memory table (``metald.boot.dhcp.leasetable.LeaseTable``) is pure and answers "which
address may this client have" in microseconds. ``LeaseStore`` writes changes to the database
with group commit: writes that arrive while a transaction is in flight are batched into the
next one, and a write's callback runs only after its transaction committed, so the server sends
an ACK only for a lease that is on disk (SQLite WAL with synchronous=NORMAL survives kill -9).

Several metald instances may share one database. The row for (network, ip) is unique and a
write takes it over only if it is ours already, expired, released or declined (one upsert with a
WHERE); a write that loses that race reports a conflict and the server answers NAK.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from enum import StrEnum
from ipaddress import IPv4Address
from socket import inet_ntoa
from typing import Any

from sqlalchemy import and_, bindparam, or_, select, text
from sqlmodel import Session
from sqlmodel import select as sm_select

from metald.boot.dhcp.leasetable import LeaseRecord, LeaseState, LeaseTable
from metald.store.db import Store, store_unavailable
from metald.store.models import Lease, as_utc

__all__ = ["LeaseRecord", "LeaseState", "LeaseStore", "LeaseTable", "WriteResult"]

log = logging.getLogger(__name__)


#: Most lease writes in one transaction.
MAX_BATCH = 500
#: Least time between WAL checkpoints of the lease writer.
CHECKPOINT_SECONDS = 1.0
#: Least time between two lease commits. A commit has a fixed cost (~20-70 us: BEGIN
#: IMMEDIATE's locks, the WAL append) whatever its size; under load, writes that arrive within
#: this window of the last commit wait for it and share the next transaction. An idle server
#: commits at once. ACKs still leave only after their commit. 4 ms: at 2,000 DORA/s it cost
#: less CPU per DORA than 2 ms (100 vs 121 us, bench/BOOT.md); the ACK waits at most that.
COMMIT_INTERVAL = 0.004
#: A commit due sooner than this is made on the next loop pass instead of on its own timer: a
#: separate wake-up of the loop costs more than committing up to this much early. (The DHCP
#: shell polls a busy socket every COMMIT_INTERVAL, so each poll's writes are due about when
#: it ends; with this they share its loop pass instead of waking the loop again.)
COMMIT_SLACK = 0.0005
#: The PostgreSQL channel on which lease writers announce what they committed (see
#: ``metald.boot.dhcp.lease_feed``), and the most payload bytes in one NOTIFY (PostgreSQL's
#: limit is 8000).
NOTIFY_CHANNEL = "metald_leases"
NOTIFY_MAX_BYTES = 7000


class WriteResult(StrEnum):
    OK = "ok"
    CONFLICT = "conflict"  # another instance holds the address
    ERROR = "error"  # the database failed; nothing was promised


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
        #: This instance's name when others share the table (PostgreSQL): each commit then
        #: announces its rows on NOTIFY_CHANNEL, so theirs learn them at once.
        self.notify_as: str | None = None
        #: Called after a batch's callbacks have run (the DHCP server sends the replies they
        #: queued then, in one sendmmsg).
        self.after_batch: Callable[[], None] | None = None

    async def load(self) -> int:
        # Oldest write first, so a MAC's current record is its last one, as before the restart
        # (a MAC may have older released rows; a binding wins a tie with them).
        recs = await self.store.run(read_all)
        for rec in recs:
            self.table.put(rec)
        return len(recs)

    async def read(
        self, network: str, macs: Iterable[str], ips: Iterable[IPv4Address]
    ) -> list[LeaseRecord]:
        """The stored rows of ``network`` for these MACs or addresses, oldest write first
        (what other instances wrote: the read-through of a table miss)."""
        return await self.store.run(_read_rows, network, sorted(set(macs)), sorted(set(ips)))

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
                    if wait > COMMIT_SLACK
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
        if self.after_batch is not None:
            try:
                self.after_batch()
            except Exception:
                log.exception("lease write batch callback failed")

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
                    results = await self.store.run(_write_batch, recs, self.clock(), self.notify_as)
                self.commits += 1
                self.rows_written += len(batch)
            except Exception as e:
                if store_unavailable(e):  # PostgreSQL restarting or cut off: no ACK, no trace
                    log.warning("lease write of %d rows failed: database unavailable", len(batch))
                else:
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


def _write_batch(
    session: Session, recs: list[LeaseRecord], now: float, notify_as: str | None = None
) -> list[WriteResult]:
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
    results = _results(conn, recs, res.rowcount)
    if notify_as is not None:
        written = [r for r, ok in zip(recs, results, strict=True) if ok is WriteResult.OK]
        notes = [{"c": NOTIFY_CHANNEL, "p": p} for p in notify_payloads(notify_as, written)]
        if notes:
            # Delivered at COMMIT, in commit order, only if the transaction commits.
            conn.execute(text("SELECT pg_notify(:c, :p)"), notes)
    session.commit()
    return results


def notify_payloads(instance: str, recs: list[LeaseRecord]) -> list[str]:
    """The NOTIFY payloads announcing ``recs``: JSON, each under NOTIFY_MAX_BYTES."""
    out: list[str] = []
    rows: list[list[Any]] = []
    size = 0
    for r in recs:
        row = [r.network, str(r.ip), r.mac, r.state.value, r.expires_at]
        n = len(json.dumps(row)) + 1
        if rows and size + n > NOTIFY_MAX_BYTES:
            out.append(json.dumps({"i": instance, "r": rows}))
            rows, size = [], 0
        rows.append(row)
        size += n
    if rows:
        out.append(json.dumps({"i": instance, "r": rows}))
    return out


def parse_notify(payload: str) -> tuple[str, list[LeaseRecord]]:
    """(the writing instance, its rows) from a payload of ``notify_payloads``."""
    doc = json.loads(payload)
    recs = [
        LeaseRecord(net, IPv4Address(ip), mac, LeaseState(state), float(exp))
        for net, ip, mac, state, exp in doc["r"]
    ]
    return str(doc["i"]), recs


def row_record(row: Lease) -> LeaseRecord:
    return LeaseRecord(
        network=row.network,
        ip=IPv4Address(row.ip),
        mac=row.mac,
        state=LeaseState(row.state),
        expires_at=_from_dt(row.expires_at),
        client_id=row.client_id,
        hostname=row.hostname,
    )


def _read_rows(
    session: Session, network: str, macs: list[str], ips: list[IPv4Address]
) -> list[LeaseRecord]:
    t = Lease.__table__  # type: ignore[attr-defined]
    match = or_(t.c.mac.in_(macs), t.c.ip.in_([str(ip) for ip in ips]))
    rows = session.exec(
        sm_select(Lease).where(and_(t.c.network == network, match))  # type: ignore[arg-type]
    ).all()
    ordered = sorted(rows, key=lambda r: (as_utc(r.updated_at), r.state == "bound"))
    return [row_record(r) for r in ordered]


def read_all(session: Session) -> list[LeaseRecord]:
    """Every stored lease, oldest write first (a MAC's current record is its last)."""
    rows = list(session.exec(sm_select(Lease)).all())
    rows.sort(key=lambda r: (as_utc(r.updated_at), r.state == LeaseState.BOUND.value))
    return [row_record(r) for r in rows]


def _results(conn: Any, recs: list[LeaseRecord], rowcount: int) -> list[WriteResult]:
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
    return results
