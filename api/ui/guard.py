"""Who is asking, on every console request: the session cookie, the principal behind it (the
token it is bound to, checked again each time), the CSRF synchronizer token on every
state-changing request, and the Origin of state-changing requests and WebSockets.

Pages and actions are declared with ``@ui_page`` / ``@ui_action``; both answer a refusal as
the API's problem details (``api.ui.render.error``)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from aiohttp import web

from api.routing import Refusal, check_inputs
from metald.auth import Principal
from metald.usecases import ui_sessions as sessions

if TYPE_CHECKING:
    from api.context import AppContext

log = logging.getLogger("metald.ui")

#: Where the console finds the API context (set by ``api.ui.setup``).
UI_CTX: web.AppKey[Any] = web.AppKey("ui_ctx", object)
COOKIE = "metald_ui"
COOKIE_PATH = "/ui"
CSRF_FIELD = "csrf"
CSRF_HEADER = "X-CSRF-Token"
UNSAFE = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass
class UiRequest:
    raw: web.Request
    ctx: AppContext
    session_id: str
    principal: Principal
    csrf: str

    @property
    def actor(self) -> str:
        return self.principal.actor


Page = Callable[[UiRequest], Awaitable[web.StreamResponse]]


def own_origin(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}"


def origin_ok(request: web.Request, *, required: bool) -> bool:
    """A request from our own pages carries our own origin. Browsers send Origin on every
    POST and WebSocket handshake; another site's page cannot forge it."""
    origin = request.headers.get("Origin")
    if origin is None:
        return not required
    return origin == own_origin(request)


async def current(request: web.Request, ctx: AppContext) -> UiRequest | None:
    """The request's live session, or None (no cookie, ended, or its token no longer acts)."""
    sid = request.cookies.get(COOKIE, "")
    if not sid:
        return None
    live = await sessions.UiSessions(ctx.store).load(sid)
    if live is None:
        return None
    return UiRequest(request, ctx, sid, live.principal, live.row.csrf)


def set_cookie(resp: web.StreamResponse, request: web.Request, session_id: str) -> None:
    resp.set_cookie(
        COOKIE,
        session_id,
        path=COOKIE_PATH,
        httponly=True,
        samesite="Strict",
        secure=request.secure,
        max_age=int(sessions.ABSOLUTE.total_seconds()),
    )


def clear_cookie(resp: web.StreamResponse) -> None:
    resp.del_cookie(COOKIE, path=COOKIE_PATH)


async def presented_csrf(request: web.Request) -> str | None:
    header = request.headers.get(CSRF_HEADER)
    if header is not None:
        return header
    if request.content_type in ("application/x-www-form-urlencoded", "multipart/form-data"):
        form = await request.post()
        value = form.get(CSRF_FIELD)
        return value if isinstance(value, str) else None
    return None


def login_redirect(request: web.Request) -> web.Response:
    target = request.path_qs if request.method == "GET" else "/ui/"
    return web.HTTPSeeOther(f"/ui/login?next={quote(target, safe='/')}")  # type: ignore[return-value]


def _refuse(request: web.Request, status: int, title: str, detail: str) -> web.Response:
    from api.ui.render import error

    log.warning("console refused %s %s: %s", request.method, request.path, title)
    return error(request, status, title, detail)


def make(
    page: Page, ctx: AppContext, *, action: bool
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp handler around a console page or action: session first (no session: to the
    login page, or 401 for a script), then for an action the Origin and the CSRF token."""

    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            check_inputs(request)  # the API's own check of path and query (NUL: a 4xx)
        except Refusal as p:
            return _refuse(request, p.status, p.title, p.detail)
        ui = await current(request, ctx)
        if ui is None:
            if request.method == "GET" and not _is_script(request):
                raise login_redirect(request)
            return _refuse(
                request,
                401,
                "Not logged in",
                "your console session has ended (logout, expiry, or its token was revoked); "
                "log in again at /ui/login",
            )
        if action or request.method in UNSAFE:
            if not origin_ok(request, required=False):
                return _refuse(
                    request,
                    403,
                    "Cross-site request refused",
                    "this request came from another site's page (its Origin is not this "
                    "console's); act from the console's own pages",
                )
            if not sessions.csrf_matches(ui.csrf, await presented_csrf(request)):
                return _refuse(
                    request,
                    403,
                    "CSRF token missing or wrong",
                    "this form was not sent by a console page of your session (its CSRF token "
                    "is missing or stale); reload the page and try again",
                )
        return await page(ui)

    return handle


def _is_script(request: web.Request) -> bool:
    from api.ui.render import wants_json

    return wants_json(request) or request.headers.get("Accept", "") == "text/event-stream"
