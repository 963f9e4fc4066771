"""/api/v1/events: the audit trail, as pages and as a live Server-Sent Events stream."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any
from urllib.parse import urlencode

from aiohttp import web
from sqlmodel import Session, col

from api.routing import ApiRequest, Router, wire_json
from api.schemas import SQL_INT_MAX, EventOut, EventPage, EventQuery
from metald.auth import Principal, Role
from metald.errors import MetaldError, Unprocessable
from metald.events import Position, final_events, position, position_of, read_events
from metald.store.models import Event, Machine

router = Router()
TAG = "events"
READERS = frozenset({Role.ADMIN, Role.TECHNICIAN, Role.ORCHESTRATOR})
#: A comment line at least this often, so proxies and clients see a quiet stream is alive.
KEEPALIVE_SECONDS = 15.0
#: Tells EventSource clients to reconnect after this many milliseconds when a stream ends.
RETRY_MS = 3000
_EVENT_ID = re.compile(r"[0-9]{1,10}")


def _filters(p: Principal, q: EventQuery) -> list[Any]:
    where: list[Any] = []
    if q.machine_id:
        where.append(col(Event.machine_id) == q.machine_id)
    if q.kind:
        where.append(col(Event.kind) == q.kind)
    if p.role is Role.ORCHESTRATOR:
        where.append(col(Event.tenant_id).in_(sorted(p.scope)))
    return where


def _page(s: Session, p: Principal, q: EventQuery, after: int, limit: int) -> EventPage:
    """A page in delivery order after event ``after`` (``next_after``: the last event's id, the
    cursor for the next page), or with ``sort=-id`` the newest events, newest first. Only
    events whose transaction and every older one has finished are listed (metald.events): a
    later page never holds one that sorts before this one's cursor."""
    if q.sort == "-id":
        rows = final_events(s, position_of(s, after), limit, _filters(p, q))
        last = max(rows, key=position, default=None)
    else:
        rows, _ = read_events(s, position_of(s, after), limit, _filters(p, q))
        last = rows[-1] if rows else None
    items = [EventOut.model_validate(r.model_dump()) for r in rows]
    return EventPage(items=items, next_after=last.id if last and last.id else after)


def _catch_up(
    s: Session, p: Principal, q: EventQuery, after: Position, limit: int
) -> tuple[list[EventOut], Position]:
    """The caller's events after ``after`` and the position up to which it has seen all."""
    rows, cursor = read_events(s, after, limit, _filters(p, q))
    return [EventOut.model_validate(r.model_dump()) for r in rows], cursor


def _matches(p: Principal, q: EventQuery, ev: Event) -> bool:
    if q.machine_id and ev.machine_id != q.machine_id:
        return False
    if q.kind and ev.kind != q.kind:
        return False
    return p.role is not Role.ORCHESTRATOR or ev.tenant_id in p.scope


def _sse(ev: EventOut) -> bytes:
    data = json.dumps(wire_json(ev.model_dump()))
    return f"id: {ev.id}\nevent: {ev.kind}\ndata: {data}\n\n".encode()


def _resume_after(req: ApiRequest, q: EventQuery) -> int:
    last_id = req.raw.headers.get("Last-Event-ID")
    if last_id is None:
        return q.after
    if not _EVENT_ID.fullmatch(last_id) or int(last_id) > SQL_INT_MAX:
        raise MetaldError(
            f"Last-Event-ID must be the id of an event (a decimal integer up to {SQL_INT_MAX}); "
            "send the id of the last event received, or omit it"
        )
    return int(last_id)


def _check_machine_scope(s: Session, p: Principal, machine_id: str | None) -> None:
    if machine_id and p.role is Role.ORCHESTRATOR:
        m = s.get(Machine, machine_id)
        if m is None or not p.can_see_machine(m.id, m.tenant_id):
            from metald.errors import NotFound

            raise NotFound(f"no machine with id {machine_id!r}")


@router.route(
    "GET",
    "/api/v1/events",
    summary="List events",
    roles=READERS,
    query=EventQuery,
    response=EventPage,
    tag=TAG,
    errors=(404,),
)
async def list_events(req: ApiRequest) -> EventPage:
    """Events in delivery order (commit order) after the ``after`` cursor; pass ``next_after``
    back to read on. Orchestrators see their tenants' events."""
    p = req.require_principal()
    q: EventQuery = req.query

    limit = req.page_limit(q)

    def run(s: Session) -> EventPage:
        _check_machine_scope(s, p, q.machine_id)
        return _page(s, p, q, q.after, limit)

    page = await req.ctx.store.run(run)
    if q.sort == "id" and len(page.items) == limit:
        params = [(k, v) for k, v in req.raw.query.items() if k != "after"]
        page.next = f"{req.raw.path}?{urlencode([*params, ('after', str(page.next_after))])}"
    return page


@router.route(
    "GET",
    "/api/v1/events/stream",
    summary="Stream events",
    roles=READERS,
    query=EventQuery,
    tag=TAG,
    raw_response="text/event-stream",
    errors=(400, 404, 429),
)
async def stream_events(req: ApiRequest) -> web.StreamResponse:
    """Server-Sent Events: each event as ``id:``/``event:``/``data:``. Resumes after
    ``Last-Event-ID`` or ``after``. A stream ends when its token is revoked or expires (within
    seconds) and after at most an hour; reconnect with ``Last-Event-ID``. Each token may hold a
    few streams and the server a bounded number (429 beyond)."""
    p = req.require_principal()
    q: EventQuery = req.query
    if q.sort != "id":
        raise Unprocessable("a stream delivers events in commit order; leave out sort")
    bus = req.ctx.bus
    after = _resume_after(req, q)

    def start(s: Session) -> Position:
        _check_machine_scope(s, p, q.machine_id)
        return position_of(s, after)

    covered = await req.ctx.store.read(start)
    limit = req.page_limit(q)
    sub = bus.subscribe(p.token_id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bus.max_life_s
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    try:
        await resp.prepare(req.raw)
        await resp.write(f": metald event stream\nretry: {RETRY_MS}\n\n".encode())
        behind = True  # events before the poller's batches are read from the store
        quiet_since = loop.time()
        while sub.closed is None:
            if behind:
                items, covered = await req.ctx.store.read(_catch_up, p, q, covered, limit)
                for ev in items:
                    await resp.write(_sse(ev))
                    quiet_since = loop.time()
                behind = len(items) == limit
                continue
            left = deadline - loop.time()
            if left <= 0:
                sub.close("the stream reached its maximum life")
                break
            batch = await sub.next(min(KEEPALIVE_SECONDS, left))
            if batch is not None:
                if batch.since > covered:
                    behind = True  # batches were missed: read the gap from the store
                    continue
                for row in batch.events:
                    if row.id is not None and position(row) > covered and _matches(p, q, row):
                        wire = batch.encoded.get(row.id)
                        if wire is None:
                            wire = _sse(EventOut.model_validate(row.model_dump()))
                            batch.encoded[row.id] = wire
                        await resp.write(wire)
                        quiet_since = loop.time()
                covered = max(covered, batch.until)
            # Events for others do not count: a filtered stream still shows it is alive.
            if sub.closed is None and loop.time() - quiet_since >= KEEPALIVE_SECONDS:
                await resp.write(b": keepalive\n\n")
                quiet_since = loop.time()
        await resp.write(f": closed: {sub.closed}; reconnect with Last-Event-ID\n\n".encode())
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        bus.unsubscribe(sub)
    return resp
