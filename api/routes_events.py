"""/api/v1/events: the audit trail, as pages and as a live Server-Sent Events stream."""

from __future__ import annotations

import asyncio
import json
import re
from urllib.parse import urlencode

from aiohttp import web

from api import workflows
from api.routing import ApiRequest, Router, wire_json
from api.schemas import SQL_INT_MAX, EventOut, EventPage, EventQuery, EventStreamQuery
from metald.auth import Role
from metald.errors import MetaldError
from metald.events import position
from metald.usecases.events import Events, matches

router = Router()
TAG = "events"
READERS = frozenset({Role.ADMIN, Role.TECHNICIAN, Role.ORCHESTRATOR})
#: A comment line at least this often, so proxies and clients see a quiet stream is alive.
KEEPALIVE_SECONDS = 15.0
#: How often a quiet stream looks whether its client is still connected: a closed tab's
#: stream is freed within this, not at the next keepalive (the cap on streams per token).
DISCONNECT_CHECK_S = 0.5
#: Tells EventSource clients to reconnect after this many milliseconds when a stream ends.
RETRY_MS = 3000
_EVENT_ID = re.compile(r"[0-9]{1,10}")


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


@router.route(
    "GET",
    "/api/v1/events",
    summary="List events",
    roles=READERS,
    query=EventQuery,
    response=EventPage,
    tag=TAG,
    errors=(404,),
    use_case=workflows.events,
)
async def list_events(req: ApiRequest, events: Events) -> EventPage:
    """Events in delivery order (commit order) after the ``after`` cursor; pass ``next_after``
    back to read on. Orchestrators see their tenants' events."""
    p = req.require_principal()
    q: EventQuery = req.query
    limit = req.page_limit(q)
    items, next_after = await events.page(p, q, q.after, limit)
    page = EventPage(items=items, next_after=next_after)
    if q.sort == "id" and len(page.items) == limit:
        params = [(k, v) for k, v in req.raw.query.items() if k != "after"]
        page.next = f"{req.raw.path}?{urlencode([*params, ('after', str(page.next_after))])}"
    return page


def _gone(raw: web.Request) -> bool:
    """Whether the stream's client has closed its connection (aiohttp drops the transport)."""
    transport = raw.transport
    return transport is None or transport.is_closing()


@router.route(
    "GET",
    "/api/v1/events/stream",
    summary="Stream events",
    roles=READERS,
    query=EventStreamQuery,
    tag=TAG,
    raw_response="text/event-stream",
    errors=(400, 404, 429),
    use_case=workflows.events,
)
async def stream_events(req: ApiRequest, events: Events) -> web.StreamResponse:
    """Server-Sent Events: each event as ``id:``/``event:``/``data:``. Resumes after
    ``Last-Event-ID`` or ``after``. A stream ends when its token is revoked or expires (within
    seconds) and after at most an hour; reconnect with ``Last-Event-ID``. Each token may hold a
    few streams and the server a bounded number (429 beyond). To start at the newest events, list
    ``GET /api/v1/events?sort=-id&limit=N`` and stream after that page's ``next_after``."""
    p = req.require_principal()
    q: EventStreamQuery = req.query
    bus = req.ctx.bus
    after = _resume_after(req, q)

    covered = await events.stream_start(p, q, after)
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
                items, covered = await events.catch_up(p, q, covered, limit)
                for ev in items:
                    await resp.write(_sse(EventOut.model_validate(ev)))
                    quiet_since = loop.time()
                behind = len(items) == limit
                continue
            left = deadline - loop.time()
            if left <= 0:
                sub.close("the stream reached its maximum life")
                break
            if _gone(req.raw):
                break  # the client went away: free its stream now, not at the next write
            batch = await sub.next(min(KEEPALIVE_SECONDS, left, DISCONNECT_CHECK_S))
            if batch is not None:
                if batch.since > covered:
                    behind = True  # batches were missed: read the gap from the store
                    continue
                for row in batch.events:
                    if row.id is not None and position(row) > covered and matches(p, q, row):
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
