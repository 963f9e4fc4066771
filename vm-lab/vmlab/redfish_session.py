"""The lab Redfish BMC's SessionService: ``POST .../Sessions`` with the BMC's credentials
answers 201 with an ``X-Auth-Token`` and the session's ``Location``; a request carrying a live
token is authenticated like one with HTTP basic auth; ``DELETE`` on the session ends it."""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from vmlab.redfish_json import ODATA, collection
from vmlab.redfish_json import error as _error
from vmlab.redfish_json import json_response as _json

SERVICE = "/redfish/v1/SessionService"
SESSIONS = SERVICE + "/Sessions"
#: Sessions one BMC keeps at most (the oldest goes first).
MAX_SESSIONS = 16


@dataclass
class Sessions:
    #: token -> (session id, user name)
    live: dict[str, tuple[str, str]] = field(default_factory=dict)
    _next: int = 1

    def open(self, user: str) -> tuple[str, str]:
        while len(self.live) >= MAX_SESSIONS:
            self.live.pop(next(iter(self.live)))
        sid, token = str(self._next), secrets.token_hex(16)
        self._next += 1
        self.live[token] = (sid, user)
        return sid, token

    def valid(self, token: str) -> bool:
        return any(hmac.compare_digest(token, t) for t in self.live)

    def close(self, sid: str) -> bool:
        for token, (s, _) in list(self.live.items()):
            if s == sid:
                del self.live[token]
                return True
        return False


SESSION_STATE = web.AppKey("sessions", Sessions)


def is_login(request: web.Request) -> bool:
    return request.method == "POST" and request.path.rstrip("/") == SESSIONS


def token_ok(request: web.Request) -> bool:
    token = request.headers.get("X-Auth-Token")
    return bool(token) and request.app[SESSION_STATE].valid(token or "")


async def session_service(request: web.Request) -> web.Response:
    return _json(
        {
            "@odata.type": "#SessionService.v1_1_8.SessionService",
            "@odata.id": SERVICE,
            "Id": "SessionService",
            "Name": "Session Service",
            "ServiceEnabled": True,
            "SessionTimeout": 1800,
            "Status": {"State": "Enabled", "Health": "OK"},
            "Sessions": {"@odata.id": SESSIONS},
        }
    )


async def sessions(request: web.Request) -> web.Response:
    ids = [sid for sid, _ in request.app[SESSION_STATE].live.values()]
    return collection("#SessionCollection.SessionCollection", SESSIONS, "Session Collection", ids)


def _session_body(sid: str, user: str) -> dict[str, Any]:
    return {
        "@odata.type": "#Session.v1_3_0.Session",
        "@odata.id": f"{SESSIONS}/{sid}",
        "Id": sid,
        "Name": f"Session {sid}",
        "UserName": user,
    }


async def session(request: web.Request) -> web.Response:
    sid = request.match_info["sid"]
    for s, user in request.app[SESSION_STATE].live.values():
        if s == sid:
            return _json(_session_body(s, user))
    return _error(404, "ResourceMissingAtURI", f"no session at {request.path}")


async def delete_session(request: web.Request) -> web.Response:
    if not request.app[SESSION_STATE].close(request.match_info["sid"]):
        return _error(404, "ResourceMissingAtURI", f"no session at {request.path}")
    return web.Response(status=204, headers=ODATA)


def login_handler(check: Any) -> Any:
    """``POST .../Sessions``; ``check(user, password)`` says whether the credentials hold."""

    async def login(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "MalformedJSON", "the request body is not valid JSON")
        user = body.get("UserName") if isinstance(body, dict) else None
        password = body.get("Password") if isinstance(body, dict) else None
        if not isinstance(user, str) or not isinstance(password, str) or not check(user, password):
            return _error(401, "InsufficientPrivilege", "invalid credentials")
        sid, token = request.app[SESSION_STATE].open(user)
        headers = {"X-Auth-Token": token, "Location": f"{SESSIONS}/{sid}"}
        return _json(_session_body(sid, user), 201, headers)

    return login


def install(app: web.Application, check: Any) -> None:
    app[SESSION_STATE] = Sessions()
    app.router.add_get(SERVICE, session_service)
    app.router.add_get(SESSIONS, sessions)
    app.router.add_post(SESSIONS, login_handler(check))
    app.router.add_get(SESSIONS + "/{sid}", session)
    app.router.add_delete(SESSIONS + "/{sid}", delete_session)
