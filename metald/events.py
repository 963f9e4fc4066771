"""Event fan-out for live streams: one poller per process, shared by every stream.

Events are rows in the store (the truth, shared by every instance on one database). The bus
runs one task while any stream is open: it reads the events after the newest it has seen, in a
read-only transaction, when a local write wakes it or every ``poll_s`` (other instances'
events), and hands each batch to every subscription. It also re-checks, every ``recheck_s``,
that each subscription's token is still live, and closes those whose token was revoked or
expired. So N streams cost one query per interval, not N.

A batch says which ids it covers (``since < id <= until``): a subscription that missed batches
(it subscribed late, or it fell more than ``queue_batches`` behind) sees a gap and catches up
from the store itself, so no event is skipped and a slow client cannot grow memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy import func
from sqlmodel import Session, col, select

from metald.errors import MetaldError
from metald.store.models import ApiToken, Event, utcnow

if TYPE_CHECKING:
    from metald.store.db import Store

log = logging.getLogger(__name__)

#: Events read per query, by the poller and by a subscription catching up.
PAGE = 500


class TooManyStreams(MetaldError):
    status = 429
    title = "Too many event streams"


@dataclass(frozen=True)
class Batch:
    """Every event with ``since < id <= until`` (``events`` in id order)."""

    since: int
    until: int
    events: tuple[Event, ...]
    #: What each event looks like on the wire, by id: encoded once for every stream.
    encoded: dict[int, bytes] = field(default_factory=dict, compare=False)


@dataclass(eq=False)
class Subscription:
    token_id: str
    queue_batches: int
    closed: str | None = None
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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), timeout)
        return self._batches.popleft() if self._batches and self.closed is None else None


# ---- store reads (pure: a session in, rows out) -------------------------------------------


def events_after(s: Session, after: int, limit: int) -> list[Event]:
    stmt = select(Event).where(col(Event.id) > after).order_by(col(Event.id)).limit(limit)
    return list(s.exec(stmt).all())


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
        self._per_token: Counter[str] = Counter()
        self._wake: asyncio.Event | None = None
        self._recheck = False
        self._task: asyncio.Task[None] | None = None
        #: Store reads the poller made (for tests and metrics).
        self.polls = 0

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
        if len(self._subs) >= self.max_streams:
            raise TooManyStreams(
                f"this metald serves at most {self.max_streams} event streams at once; "
                "retry later, or page with GET /api/v1/events",
                retry_after_s=int(self.poll_s * 5) or 1,
            )
        if self._per_token[token_id] >= self.max_streams_per_token:
            raise TooManyStreams(
                f"a token may hold at most {self.max_streams_per_token} event streams at once; "
                "close one first",
                retry_after_s=int(self.poll_s * 5) or 1,
            )
        sub = Subscription(token_id, self.queue_batches)
        self._subs.add(sub)
        self._per_token[token_id] += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="event-poller")
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self._subs:
            self._subs.discard(sub)
            self._per_token[sub.token_id] -= 1
            if self._per_token[sub.token_id] <= 0:
                del self._per_token[sub.token_id]
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
            head = await store.read(newest_event_id)
            # Tell the streams where the poller starts: an event committed between a stream's
            # own catch-up read and this one is in no batch, and a stream behind ``head`` must
            # read it from the store (or it would wait for the next event to notice the gap).
            self._publish(Batch(head, head, ()))
            next_poll = next_check = loop.time()
            while self._subs:
                if wake.is_set() or loop.time() >= next_poll:
                    wake.clear()
                    rows = await store.read(events_after, head, PAGE)
                    self.polls += 1
                    next_poll = loop.time() + self.poll_s
                    if rows:
                        assert rows[-1].id is not None
                        batch = Batch(head, rows[-1].id, tuple(rows))
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
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        wake.wait(), max(0.0, min(next_poll, next_check) - loop.time())
                    )
        except asyncio.CancelledError:
            raise
        except Exception:
            # A store outage: end every stream (clients reconnect with Last-Event-ID).
            log.exception("event poller failed; closing %d streams", len(self._subs))
            for sub in list(self._subs):
                sub.close("metald could not read events; reconnect")
