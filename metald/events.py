"""Event fan-out for live streams: one poller per process, shared by every stream.

Events are rows in the store (the truth, shared by every instance on one database). The bus
runs one task while any stream is open: it reads the events after the newest position it has
seen, in a read-only transaction, when a local write wakes it or every ``poll_s`` (other
instances' events), and hands each batch to every subscription. It also re-checks, every
``recheck_s``, that each subscription's token is still live, and closes those whose token was
revoked or expired. So N streams cost one query per interval, not N.

Order. On PostgreSQL an event's id comes from a sequence at INSERT, but transactions commit in
another order: id 11 may commit after id 12 was read, and "after 12" would skip it forever.
So every reader here follows *positions*, not ids: an event's position is ``(txid, id)``, where
``txid`` is the id of the transaction that wrote it (``events.txid``, set by the server). A read
computes the horizon X, the xmin of its snapshot: every transaction with an id below X has
finished, and every transaction that can still write has an id of X or more. It returns only
rows with ``txid < X`` (final: no row can appear among them later), in position order, so a
cursor never passes a row that can still commit. Delivery waits for the event's transaction
and every older one still running to finish (metald's transactions are short; a long one
elsewhere on the database delays streams, it loses nothing). Nothing is serialised: writers
commit as before. On SQLite writers take the database lock one at a time, ids are in commit
order, and a position is ``(0, id)``.

Public cursors stay event ids (``after``, ``next_after``, SSE ``id:``/Last-Event-ID): events
are delivered in position order, so "after event N" means "after N's position", which is exact
for any event a reader received (:func:`position_of`).

A batch says which positions it covers (``since < position <= until``): a subscription that
missed batches (it subscribed late, or it fell more than ``queue_batches`` behind) sees a gap
and catches up from the store itself, so no event is skipped and a slow client cannot grow
memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import BigInteger, Text, func, tuple_
from sqlmodel import Session, col, select

from metald.limits import Hold, Limiter, TooMany
from metald.service import wait_event
from metald.store.models import ApiToken, Event, utcnow

if TYPE_CHECKING:
    from metald.store.db import Store

log = logging.getLogger(__name__)

#: Events read per query, by the poller and by a subscription catching up.
PAGE = 500
#: The poller's first re-read while committed events wait for an older transaction (doubling
#: up to ``poll_s``).
PENDING_RETRY_S = 0.02


class TooManyStreams(TooMany):
    title = "Too many event streams"


#: Where an event sorts for readers: (writing transaction id, event id); txid 0 on SQLite.
Position = tuple[int, int]
START: Position = (0, 0)


def position(ev: Event) -> Position:
    assert ev.id is not None
    return (ev.txid or 0, ev.id)


@dataclass(frozen=True)
class Batch:
    """Every event with ``since < position <= until`` (``events`` in position order)."""

    since: Position
    until: Position
    events: tuple[Event, ...]
    #: What each event looks like on the wire, by id: encoded once for every stream.
    encoded: dict[int, bytes] = field(default_factory=dict, compare=False)


@dataclass(eq=False)
class Subscription:
    token_id: str
    queue_batches: int
    closed: str | None = None
    #: Its place under the bus's caps (``EventBus.limiter``).
    hold: Hold | None = None
    _batches: deque[Batch] = field(init=False)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        # Oldest batches fall off when the reader lags: it then sees a gap and catches up.
        self._batches = deque(maxlen=self.queue_batches)

    def put(self, batch: Batch) -> None:
        self._batches.append(batch)
        self._ready.set()

    def close(self, reason: str) -> None:
        if self.closed is None:
            self.closed = reason
        self._ready.set()

    async def next(self, timeout: float) -> Batch | None:
        """The next batch, or None after ``timeout`` seconds or when the subscription closed."""
        if not self._batches and self.closed is None:
            self._ready.clear()
            await wait_event(self._ready, timeout)
        return self._batches.popleft() if self._batches and self.closed is None else None


# ---- store reads (pure: a session in, rows out) -------------------------------------------


def _is_pg(s: Session) -> bool:
    return s.get_bind().dialect.name == "postgresql"


def _horizon(s: Session) -> int:
    """PostgreSQL: every transaction with a smaller id has finished; none can still write."""
    xmin = func.pg_snapshot_xmin(func.pg_current_snapshot())
    return int(s.exec(select(xmin.cast(Text).cast(BigInteger))).one())


def read_events(
    s: Session, after: Position, limit: int, where: Iterable[Any] = ()
) -> tuple[list[Event], Position]:
    """Up to ``limit`` final events after ``after`` that match ``where``, in position order,
    and the cursor to read on from: the last row's position when the page is full, else the
    position below which every event is final and was read (no later commit lands there)."""
    if _is_pg(s):
        horizon = _horizon(s)
        stmt = select(Event).where(
            tuple_(col(Event.txid), col(Event.id)) > tuple_(*after), col(Event.txid) < horizon
        )
        order: tuple[Any, ...] = (col(Event.txid), col(Event.id))
        done: Position = (horizon, 0)
    else:
        # One writer at a time: ids are in commit order, and the read transaction's snapshot
        # holds every id up to the newest it sees.
        newest = newest_event_id(s)
        stmt = select(Event).where(col(Event.id) > after[1], col(Event.id) <= newest)
        order = (col(Event.id),)
        done = (0, newest)
    for w in where:
        stmt = stmt.where(w)
    rows = list(s.exec(stmt.order_by(*order).limit(limit)).all())
    if len(rows) == limit:
        return rows, position(rows[-1])
    return rows, max(after, done)


def final_events(s: Session, after: Position, limit: int, where: Iterable[Any] = ()) -> list[Event]:
    """The newest ``limit`` final events after ``after`` matching ``where``, newest id first
    (a "tail": positions and ids agree on SQLite, and nearly so on PostgreSQL)."""
    if _is_pg(s):
        stmt = select(Event).where(
            tuple_(col(Event.txid), col(Event.id)) > tuple_(*after), col(Event.txid) < _horizon(s)
        )
    else:
        stmt = select(Event).where(col(Event.id) > after[1])
    for w in where:
        stmt = stmt.where(w)
    return list(s.exec(stmt.order_by(col(Event.id).desc()).limit(limit)).all())


def poll_events(s: Session, after: Position, limit: int) -> tuple[list[Event], Position, bool]:
    """The poller's read: :func:`read_events`, and whether committed events wait beyond the
    horizon (an older transaction still runs): then the poller reads again soon, as nothing
    else wakes it when that transaction ends."""
    rows, cursor = read_events(s, after, limit)
    pending = False
    if _is_pg(s) and len(rows) < limit:
        stmt = select(Event.id).where(col(Event.txid) >= cursor[0]).limit(1)
        pending = s.exec(stmt).first() is not None
    return rows, cursor, pending


def position_of(s: Session, event_id: int) -> Position:
    """The cursor "after event ``event_id``": its position when the event exists (exact for
    every event a reader received). For an id that names no event, a cursor before every
    event with a greater id (some with smaller ids may come again: nothing is skipped)."""
    if event_id <= 0:
        return START
    if not _is_pg(s):
        return (0, event_id)
    txid = s.exec(select(Event.txid).where(col(Event.id) == event_id)).first()
    if txid is not None:
        return (txid, event_id)
    later = s.exec(select(func.min(Event.txid)).where(col(Event.id) > event_id)).one()
    horizon = _horizon(s)
    return (min(horizon, later) if later is not None else horizon, 0)


def head_position(s: Session) -> Position:
    """The cursor after every event that is final now."""
    return (_horizon(s), 0) if _is_pg(s) else (0, newest_event_id(s))


def newest_event_id(s: Session) -> int:
    return s.exec(select(func.max(Event.id))).one() or 0


def live_token_ids(s: Session, token_ids: Iterable[str], now: datetime | None = None) -> set[str]:
    """The ids among ``token_ids`` whose token is neither revoked nor expired."""
    now = now or utcnow()
    ids = sorted(set(token_ids))
    if not ids:
        return set()
    stmt = select(ApiToken.id).where(
        col(ApiToken.id).in_(ids),
        col(ApiToken.revoked_at).is_(None),
        (col(ApiToken.expires_at).is_(None)) | (col(ApiToken.expires_at) > now),
    )
    return set(s.exec(stmt).all())


# ---- the bus --------------------------------------------------------------------------------


class EventBus:
    """Wakes and feeds live event streams. ``bind`` gives it the store (the app does)."""

    def __init__(
        self,
        *,
        poll_s: float = 1.0,
        recheck_s: float = 5.0,
        max_streams: int = 256,
        max_streams_per_token: int = 8,
        max_life_s: float = 3600.0,
        queue_batches: int = 64,
    ) -> None:
        self.poll_s = poll_s
        self.recheck_s = recheck_s
        self.max_streams = max_streams
        self.max_streams_per_token = max_streams_per_token
        #: A stream ends after this long; the client reconnects with Last-Event-ID.
        self.max_life_s = max_life_s
        self.queue_batches = queue_batches
        self.store: Store | None = None
        self._subs: set[Subscription] = set()
        #: The caps on streams (``metald.limits``: the same mechanism as mesh long-polls and
        #: console viewers).
        self.limiter = Limiter(
            "event streams",
            total=max_streams,
            per={"token": max_streams_per_token},
            retry_after_s=int(poll_s * 5) or 1,
            advice="retry later, or page with GET /api/v1/events",
            error=TooManyStreams,
        )
        self._wake: asyncio.Event | None = None
        self._recheck = False
        self._task: asyncio.Task[None] | None = None
        #: Store reads the poller made (for tests and metrics).
        self.polls = 0
        #: Of those, the re-reads while committed events waited behind an older transaction.
        self.retries = 0

    def bind(self, store: Store) -> None:
        self.store = store

    def _event(self) -> asyncio.Event:
        if self._wake is None:
            self._wake = asyncio.Event()
        return self._wake

    def notify(self, *, tokens: bool = False) -> None:
        """Wake the poller now (call on the loop after committing events; ``tokens=True``
        after revoking a token, so its streams end at once)."""
        if tokens:
            self._recheck = True
        self._event().set()

    @property
    def streams(self) -> int:
        return len(self._subs)

    def subscribe(self, token_id: str) -> Subscription:
        """A new subscription for a stream, or TooManyStreams (429) past either cap."""
        if self.store is None:
            raise RuntimeError("EventBus.bind(store) was not called")
        sub = Subscription(token_id, self.queue_batches)
        sub.hold = self.limiter.take(token=token_id)
        self._subs.add(sub)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="event-poller")
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self._subs:
            self._subs.discard(sub)
        if sub.hold is not None:
            self.limiter.give(sub.hold)
        sub.close("unsubscribed")
        if not self._subs:
            self._event().set()  # the poller sees no subscriber and ends

    async def close(self) -> None:
        for sub in list(self._subs):
            sub.close("metald is stopping")
            self.unsubscribe(sub)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _publish(self, batch: Batch) -> None:
        for sub in self._subs:
            sub.put(batch)

    async def _check_tokens(self) -> None:
        assert self.store is not None
        held = {s.token_id for s in self._subs}
        live = await self.store.read(live_token_ids, held)
        for sub in list(self._subs):
            # Streams opened during the read were authenticated just now: not judged here.
            if sub.token_id in held and sub.token_id not in live:
                sub.close("the token was revoked or has expired")

    async def _run(self) -> None:
        assert self.store is not None
        store = self.store
        loop = asyncio.get_running_loop()
        wake = self._event()
        try:
            head = await store.read(head_position)
            # Tell the streams where the poller starts: an event committed between a stream's
            # own catch-up read and this one is in no batch, and a stream behind ``head`` must
            # read it from the store (or it would wait for the next event to notice the gap).
            self._publish(Batch(head, head, ()))
            next_poll = next_check = loop.time()
            retry = PENDING_RETRY_S / 2
            pending = False
            while self._subs:
                if wake.is_set() or loop.time() >= next_poll:
                    if pending and not wake.is_set():
                        self.retries += 1
                    wake.clear()
                    rows, cursor, pending = await store.read(poll_events, head, PAGE)
                    self.polls += 1
                    retry = min(retry * 2, self.poll_s) if pending else PENDING_RETRY_S / 2
                    next_poll = loop.time() + (retry if pending else self.poll_s)
                    # Only a batch with events moves ``head``: a stream then sees one range
                    # per batch and no gap in between (an empty read changes nothing for it).
                    if rows:
                        batch = Batch(head, cursor, tuple(rows))
                        head = batch.until
                        self._publish(batch)
                    if len(rows) == PAGE:
                        continue  # more are waiting
                if self._recheck or loop.time() >= next_check:
                    self._recheck = False
                    next_check = loop.time() + self.recheck_s
                    await self._check_tokens()
                if not self._subs:
                    break
                # Sleep until a write wakes us, the next poll, or the next token re-check.
                await wait_event(wake, min(next_poll, next_check) - loop.time())
        except asyncio.CancelledError:
            raise
        except Exception:
            # A store outage: end every stream (clients reconnect with Last-Event-ID).
            log.exception("event poller failed; closing %d streams", len(self._subs))
            for sub in list(self._subs):
                sub.close("metald could not read events; reconnect")
