"""What stays open: the event stream the live pages follow (the API's own SSE stream, the
shared fan-out, for the session's principal) and the serial console WebSocket (the API's
console route). Once the session ends (logout, expiry, or its token revoked or expired) the
stream ends within ``RECHECK_S``, the console within ``api.routes_console.RECHECK_S`` (its
own watch asks ``ConsoleCaller.still_valid``).

Browsers cannot put a token in a WebSocket's or an EventSource's headers, so both ride on the
session cookie (SameSite=Strict, so another site's page cannot send it), and the WebSocket
additionally must come from a page of this console: its ``Origin`` must be ours (stops
cross-site WebSocket hijacking) and it carries the session's CSRF token."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

from aiohttp import web

from api.routing import Refusal, check_inputs
from api.ui.dispatch import Api, Refused
from api.ui.guard import COOKIE, CSRF_FIELD, UI_CTX, UiRequest, current, origin_ok
from api.ui.render import error
from metald.usecases import ui_sessions as sessions

#: How often an open stream or console checks that its session still stands.
RECHECK_S = 2.0


def _still_valid(ui: UiRequest):  # type: ignore[no-untyped-def]
    async def check() -> bool:
        return await sessions.UiSessions(ui.ctx.store).load(ui.session_id) is not None

    return check


class ConsoleCaller:
    """The session as the API's console route sees its caller (``ApiRequest.session``): it
    re-checks the session, and in a fleet it is carried to the instance that owns the BMC by
    the session's own cookie, to that instance's console route (same path, same CSRF token in
    the query), with that instance's Origin. The owner shares the store: it resolves the same
    session and principal (the token it is bound to, checked again), applies the same roles,
    records the attach under the same actor, and ends the console when the session ends. The
    user's API token never travels: the store keeps only its id."""

    def __init__(self, ui: UiRequest) -> None:
        self.ui = ui

    async def still_valid(self) -> bool:
        return await _still_valid(self.ui)()

    def forward_headers(self, owner_url: str) -> dict[str, str]:
        u = urlsplit(owner_url)
        return {"Cookie": f"{COOKIE}={self.ui.session_id}", "Origin": f"{u.scheme}://{u.netloc}"}


async def _while_session(ui: UiRequest, work: asyncio.Task[web.StreamResponse]) -> None:
    check = _still_valid(ui)
    while not work.done():
        done, _ = await asyncio.wait({work}, timeout=RECHECK_S)
        if done:
            return
        if not await check():
            work.cancel()
            return


class Live:
    def __init__(self, api: Api) -> None:
        self.api = api
        #: The shared stream of each browser session (``mux=1``: the tabs' SharedWorker):
        #: session id -> its stream's task. A session's new shared stream ends the old one
        #: (a worker that went away), so a session holds one stream whatever its tabs.
        self.shared: dict[str, asyncio.Task[web.StreamResponse]] = {}

    async def events(self, ui: UiRequest) -> web.StreamResponse:
        """The API's event stream (``GET /api/v1/events/stream``) for this session. With
        ``mux=1`` it is the session's one shared stream (``static/events-worker.js``)."""
        query = {k: v for k in ("after", "machine_id", "kind") if (v := ui.raw.query.get(k))}
        spec = self.api.spec("GET", "/api/v1/events/stream")
        work = asyncio.ensure_future(self.api.invoke(ui, spec, {}, query, None, ui.raw))
        shared = ui.raw.query.get("mux") == "1"
        if shared:
            old = self.shared.get(ui.session_id)
            if old is not None and not old.done():
                old.cancel()
            self.shared[ui.session_id] = work
        watch = asyncio.ensure_future(_while_session(ui, work))
        try:
            resp = await work
        except asyncio.CancelledError:
            return web.Response(status=401, text="the session ended")
        except Refused as r:
            return error(ui.raw, r.status, r.title, r.detail)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            if shared and self.shared.get(ui.session_id) is work:
                del self.shared[ui.session_id]
        return resp

    async def console(self, request: web.Request) -> web.StreamResponse:
        """The machine's serial console (``GET /api/v1/machines/{id}/console``) for this
        session: cookie, our own Origin, and the session's CSRF token in the query."""
        ctx = request.app[UI_CTX]
        try:
            check_inputs(request)  # the API's own check of path and query (NUL: a 4xx)
        except Refusal as p:
            return error(request, p.status, p.title, p.detail)
        ui = await current(request, ctx)
        if ui is None:
            return error(request, 401, "Not logged in", "log in to the console first (/ui/login)")
        if not origin_ok(request, required=True):
            return error(
                request,
                403,
                "Cross-site WebSocket refused",
                "a console WebSocket must be opened by a page of this console (its Origin "
                "header must be this server's)",
            )
        if not sessions.csrf_matches(ui.csrf, request.query.get(CSRF_FIELD)):
            return error(
                request,
                403,
                "CSRF token missing or wrong",
                "open the console from the machine's page (the WebSocket must carry the "
                "session's CSRF token)",
            )
        spec = self.api.spec("GET", "/api/v1/machines/{id}/console")
        mode = request.query.get("mode", "auto")
        try:
            return await self.api.invoke(
                ui,
                spec,
                {"id": request.match_info["id"]},
                {"mode": mode},
                None,
                request,
                session=ConsoleCaller(ui),
            )
        except Refused as r:
            return error(request, r.status, r.title, r.detail)
