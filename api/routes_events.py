"""/api/v1/events: the audit trail, as pages and as a live Server-Sent Events stream."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from sqlmodel import Session, select

from api.routing import ApiRequest, Router
from api.schemas import EventOut, EventPage, EventQuery
from metald.auth import Principal, Role
from metald.store.models import Event, Machine

router = Router()
TAG = "events"
READERS = frozenset({Role.ADMIN, Role.TECHNICIAN, Role.ORCHESTRATOR})
#: How often a stream re-reads the store when nothing local woke it (other instances' events).
POLL_SECONDS = 1.0
KEEPALIVE_SECONDS = 15.0


def _select(p: Principal, q: EventQuery, after: int):  # type: ignore[no-untyped-def]
    stmt = select(Event).where(Event.id > after)  # type: ignore[operator]
    if q.machine_id:
        stmt = stmt.where(Event.machine_id == q.machine_id)
    if q.kind:
        stmt = stmt.where(Event.kind == q.kind)
    if p.role is Role.ORCHESTRATOR:
        stmt = stmt.where(Event.tenant_id.in_(sorted(p.scope)))  # type: ignore[union-attr]
    return stmt.order_by(Event.id).limit(q.limit)  # type: ignore[arg-type]


def _page(s: Session, p: Principal, q: EventQuery, after: int) -> EventPage:
    rows = s.exec(_select(p, q, after)).all()
    items = [EventOut.model_validate(r.model_dump()) for r in rows]
    return EventPage(items=items, next_after=items[-1].id if items else after)


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
)
async def list_events(req: ApiRequest) -> EventPage:
    """Events in id order after the ``after`` cursor. Orchestrators see their tenants' events."""
    p = req.require_principal()
    q: EventQuery = req.query

    def run(s: Session) -> EventPage:
        _check_machine_scope(s, p, q.machine_id)
        return _page(s, p, q, q.after)

    return await req.ctx.store.run(run)


@router.route(
    "GET",
    "/api/v1/events/stream",
    summary="Stream events",
    roles=READERS,
    query=EventQuery,
    tag=TAG,
    raw_response="text/event-stream",
)
async def stream_events(req: ApiRequest) -> web.StreamResponse:
    """Server-Sent Events: each event as ``id:``/``event:``/``data:``. Resumes after
    ``Last-Event-ID`` or ``after``; ``after=-1`` is not allowed, use the list call's cursor."""
    p = req.require_principal()
    q: EventQuery = req.query
    after = q.after
    last_id = req.raw.headers.get("Last-Event-ID", "")
    if last_id.isdigit():
        after = int(last_id)
    await req.ctx.store.run(_check_machine_scope, p, q.machine_id)
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await resp.prepare(req.raw)
    await resp.write(b": metald event stream\n\n")
    idle = 0.0
    try:
        while True:
            page = await req.ctx.store.run(_page, p, q, after)
            for ev in page.items:
                data = json.dumps(ev.model_dump(mode="json"))
                await resp.write(f"id: {ev.id}\nevent: {ev.kind}\ndata: {data}\n\n".encode())
            after = page.next_after
            if len(page.items) == q.limit:
                continue
            t0 = asyncio.get_running_loop().time()
            await req.ctx.bus.wait(POLL_SECONDS)
            idle += asyncio.get_running_loop().time() - t0
            if idle >= KEEPALIVE_SECONDS:
                await resp.write(b": keepalive\n\n")
                idle = 0.0
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    return resp
