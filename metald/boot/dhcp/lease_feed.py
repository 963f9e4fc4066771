"""Keeps this instance's lease table current with what the other instances on one PostgreSQL
write: LISTEN on the channel their lease writer NOTIFYs after each commit.

Design (several instances serve one provisioning network, docs/fleet.md):
- Every lease commit announces its rows (``LeaseStore.notify_as``), in the same transaction,
  so a notification exists exactly when the rows do, and PostgreSQL delivers them in commit
  order. Each instance learns the others' rows within milliseconds of their commit.
- On (re)connecting, after LISTEN is in place, the whole table is read again: what was
  written while the feed was down is learnt, and nothing after LISTEN can be missed.
- A miss (a client this table does not know) is read through from the store by the server
  before it decides (``DhcpServer``), which covers the moment between a peer's commit and its
  notification, and a feed that is down.
- ``LeaseTable.learn`` never lets a stored "free" overwrite an address this table holds (its
  own offers are never stored, its own bindings may not have committed yet): the worst a late
  notification can do is keep an address held until it expires, never give it twice. The
  (network, ip) unique row stays the arbiter: an ACK leaves only after its row committed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import psycopg

from metald.boot.dhcp.lease_store import NOTIFY_CHANNEL, LeaseStore, parse_notify, read_all
from metald.service import cancel
from metald.store import libpq_conninfo

log = logging.getLogger(__name__)

#: Waits between reconnects of the LISTEN connection: doubling from the first to the last.
RETRY_S = (0.5, 5.0)


class LeaseFeed:
    name = "dhcp-lease-feed"

    def __init__(
        self, leases: LeaseStore, instance: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.leases = leases
        self.instance = instance
        self.clock = clock
        self.learnt = 0
        #: Set while LISTEN is in place and the table was reloaded after it.
        self.connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._resync: asyncio.Task[int] | None = None
        self._conn: psycopg.AsyncConnection | None = None

    def _conninfo(self) -> str:
        return libpq_conninfo(self.leases.store.engine)

    async def start(self) -> None:
        self.connected.clear()
        self._task = asyncio.create_task(self._run(), name=self.name)

    def request_resync(self) -> None:
        """Read the whole table again soon (after this instance was cut off)."""
        if self._task is not None and (self._resync is None or self._resync.done()):
            self._resync = asyncio.get_running_loop().create_task(self.resync())

    async def stop(self) -> None:
        await cancel(self._resync)
        await cancel(self._task)
        self._task = self._resync = None
        self.connected.clear()
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def resync(self) -> int:
        """Learn every stored lease (after a gap in the feed)."""
        recs = await self.leases.store.run(read_all)
        now, learn = self.clock(), self.leases.table.learn
        for rec in recs:
            learn(rec, now)
        return len(recs)

    async def _run(self) -> None:
        wait = RETRY_S[0]
        while True:
            try:
                await self._listen()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the store is down: retry, read-through covers
                log.warning("lease feed: %s: %s; retrying in %.1f s", type(e).__name__, e, wait)
            self.connected.clear()
            if self._conn is not None:
                await self._conn.close()
                self._conn = None
            await asyncio.sleep(wait)
            wait = min(wait * 2, RETRY_S[1])

    async def _listen(self) -> None:
        self._conn = await psycopg.AsyncConnection.connect(
            self._conninfo(),
            autocommit=True,
            connect_timeout=5,
            keepalives=1,
            keepalives_idle=5,
            keepalives_interval=2,
            keepalives_count=3,
            tcp_user_timeout=10000,
        )
        await self._conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
        n = await self.resync()
        log.info("lease feed listening; %d stored leases read", n)
        self.connected.set()
        async for note in self._conn.notifies():
            self._apply(note.payload)

    def _apply(self, payload: str) -> None:
        try:
            writer, recs = parse_notify(payload)
        except (ValueError, KeyError, TypeError):
            log.warning("lease feed: unreadable notification dropped")
            return
        if writer == self.instance:
            return
        now, learn = self.clock(), self.leases.table.learn
        for rec in recs:
            learn(rec, now)
        self.learnt += len(recs)
