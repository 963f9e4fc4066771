"""``GET /api/v1/machines/{id}/console``: a machine's serial console as a WebSocket.

Frames: binary both ways is the console's bytes (from the client only the writer's are sent
on; a read-only viewer's are dropped with a note). Text frames are JSON notes: the server sends
``{"type": "hello", "mode", "writer", "buffered"}`` first, then the buffered output (up to
64 KiB) as binary, then live output and ``{"type": "status", "state", "detail"}`` notes; the
client may send ``{"type": "break"}`` (a serial break, writer only).

Staff only (admin, technician): a writable serial console is root on the machine (boot
loader, single-user mode), and what it prints spans tenants (a wipe, the next tenant's boot),
so orchestrators get none, not even read-only. The caller's token is checked again every
``RECHECK_S`` and the socket closed once it is revoked or expired.

In a fleet the BMC's SOL runs on the instance that owns the BMC: the route declares it
(``owner=Owner.CONSOLE``) and the router proxies the WebSocket there from any other instance
with the caller's own credential (the owner authorizes it again), so clients need only one URL.
A proxied connection is never proxied again; its mark is signed
(``metald.fleet.forward_auth``), so a client cannot claim to be a proxying instance and get a
non-owner to open its own SOL session. That credential is the
bearer token, or for the web console's session (which holds none, ``ApiRequest.session``) the
session's cookie to the owner's own console route: the owner resolves the same principal from
the shared store and checks the session there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Literal

from aiohttp import WSMsgType, web
from pydantic import Field

from api.routing import STAFF, ApiRequest, Owner, Router, bearer_token
from api.schemas import In
from metald.bmc.console import ConsoleService, Viewer
from metald.errors import MetaldError, ServiceUnavailable
from metald.usecases.tokens import still_authenticated

router = Router()
TAG = "bmcs"
#: How often an open console re-checks that its token is still valid.
RECHECK_S = 5.0
#: Keystrokes in one frame (a paste larger than this is refused, not split silently).
MAX_INPUT_BYTES = 4096


class ConsoleQuery(In):
    mode: Literal["auto", "write", "read"] = Field(
        default="auto",
        description="write (409 if someone else writes), read, or auto: write when nobody does",
    )


class NotAWebSocket(MetaldError):
    status = 426
    title = "Upgrade required"


def _console(req: ApiRequest) -> ConsoleService:
    svc = req.ctx.services.console
    if svc is None:
        raise ServiceUnavailable("serial consoles are not running in this metald instance")
    return svc


@router.route(
    "GET",
    "/api/v1/machines/{id}/console",
    summary="Attach to a machine's serial console",
    roles=STAFF,
    query=ConsoleQuery,
    tag=TAG,
    raw_response="application/octet-stream",
    errors=(404, 409, 426, 429, 502, 503),
    max_body=MAX_INPUT_BYTES * 2,
    owner=Owner.CONSOLE,
)
async def console(req: ApiRequest) -> web.StreamResponse:
    """Upgrades to a WebSocket carrying the serial console (IPMI Serial-over-LAN through the
    machine's BMC). One writer at a time; others read. Attaching and leaving are events."""
    ws_check = web.WebSocketResponse()
    if not ws_check.can_prepare(req.raw).ok:
        raise NotAWebSocket(
            "this is a WebSocket endpoint: connect with a WebSocket client "
            "(metalctl machines console ID)"
        )
    machine_id = req.params["id"]
    svc = _console(req)
    await svc.check(machine_id)
    q: ConsoleQuery = req.query
    actor = req.actor
    # Past a viewer cap (per token, per machine, per instance) a 429 before the WebSocket
    # opens and before any event is written.
    viewer, buffered = await svc.attach(
        machine_id, actor, q.mode, token=req.require_principal().token_id
    )
    req.ctx.bus.notify()
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=MAX_INPUT_BYTES * 2)
    try:
        await ws.prepare(req.raw)
        await ws.send_json(
            {
                "type": "hello",
                "machine_id": machine_id,
                "mode": "write" if viewer.writer else "read",
                "writer": svc.status(machine_id)["writer"],
                "buffered": len(buffered),
                **{k: v for k, v in svc.status(machine_id).items() if k in ("state", "detail")},
            }
        )
        if buffered:
            await ws.send_bytes(buffered)
        await _pump(req, ws, svc, machine_id, viewer)
    finally:
        await svc.detach(machine_id, viewer)
        req.ctx.bus.notify()
        await ws.close()
    return ws


async def _pump(
    req: ApiRequest, ws: web.WebSocketResponse, svc: ConsoleService, machine_id: str, v: Viewer
) -> None:
    loop = asyncio.get_running_loop()
    secret = bearer_token(req.raw) or ""

    async def outbound() -> str:
        while True:
            item = await v.queue.get()
            if item is None:
                return v.cut_reason or "closed"
            if isinstance(item, bytes):
                await ws.send_bytes(item)
            else:
                await ws.send_json(item)

    session = req.session

    async def token_watch() -> str:
        while True:
            await asyncio.sleep(RECHECK_S)
            if session is not None:
                if not await session.still_valid():
                    return "the session ended, or its token was revoked or expired"
            elif not await still_authenticated(req.ctx.store, secret):
                return "the token was revoked or expired"

    async def inbound() -> str:
        told = False
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                data: bytes = msg.data
                if len(data) > MAX_INPUT_BYTES:
                    await ws.send_json({"type": "error", "detail": "input frame too large"})
                    continue
                if not svc.type(machine_id, v, data) and not told:
                    told = True
                    await ws.send_json(
                        {
                            "type": "error",
                            "detail": "read-only: another viewer is the writer"
                            if not v.writer
                            else "the console link is not up; keys were dropped",
                        }
                    )
            elif msg.type == WSMsgType.TEXT:
                try:
                    note = json.loads(msg.data)
                except ValueError:
                    note = None
                if isinstance(note, dict) and note.get("type") == "break":
                    if not svc.send_break(machine_id, v):
                        await ws.send_json({"type": "error", "detail": "break not sent"})
                else:
                    await ws.send_json(
                        {"type": "error", "detail": 'text frames are JSON notes: {"type": "break"}'}
                    )
            elif msg.type == WSMsgType.ERROR:
                break
        return "client left"

    tasks = [loop.create_task(f()) for f in (outbound, token_watch, inbound)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        reason = next(iter(done)).result()
    except Exception as e:  # noqa: BLE001 - the socket broke under a send
        reason = type(e).__name__
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
    if not ws.closed and reason != "client left":
        with contextlib.suppress(Exception):
            await ws.send_json({"type": "closed", "detail": reason})
