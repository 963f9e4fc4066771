"""The lab Redfish BMC's AccountService: the BMC's own user (account 1) and whatever accounts
a client adds (``POST .../Accounts``: UserName, Password, RoleId) or removes (``DELETE``).
Every enabled account can log in, as on a real BMC, so an account a tenant adds in band is a
way back into the machine after its release, which metald must remove."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from vmlab.redfish_json import ODATA, collection
from vmlab.redfish_json import error as _error
from vmlab.redfish_json import json_response as _json

SERVICE = "/redfish/v1/AccountService"
ACCOUNTS = SERVICE + "/Accounts"
ROLES = SERVICE + "/Roles"
ROLE_IDS = ("Administrator", "Operator", "ReadOnly")
MAX_ACCOUNTS = 16


@dataclass
class Account:
    id: str
    user: str
    password: str = field(repr=False)
    role: str = "Administrator"
    enabled: bool = True


@dataclass
class Accounts:
    by_id: dict[str, Account] = field(default_factory=dict)
    _next: int = 2

    def check(self, user: str, password: str) -> bool:
        ok = False
        for a in self.by_id.values():
            given, wanted = f"{user}:{password}".encode(), f"{a.user}:{a.password}".encode()
            ok |= a.enabled and hmac.compare_digest(given, wanted)
        return ok


ACCOUNT_STATE = web.AppKey("accounts", Accounts)


def _body(a: Account) -> dict[str, Any]:
    return {
        "@odata.type": "#ManagerAccount.v1_10_0.ManagerAccount",
        "@odata.id": f"{ACCOUNTS}/{a.id}",
        "Id": a.id,
        "Name": f"User Account {a.id}",
        "UserName": a.user,
        "Password": None,
        "RoleId": a.role,
        "Enabled": a.enabled,
        "Locked": False,
        "AccountTypes": ["Redfish"],
        "Links": {"Role": {"@odata.id": f"{ROLES}/{a.role}"}},
    }


async def account_service(request: web.Request) -> web.Response:
    return _json(
        {
            "@odata.type": "#AccountService.v1_13_0.AccountService",
            "@odata.id": SERVICE,
            "Id": "AccountService",
            "Name": "Account Service",
            "ServiceEnabled": True,
            "Status": {"State": "Enabled", "Health": "OK"},
            "MinPasswordLength": 8,
            "MaxPasswordLength": 64,
            "Accounts": {"@odata.id": ACCOUNTS},
            "Roles": {"@odata.id": ROLES},
        }
    )


async def accounts(request: web.Request) -> web.Response:
    ids = list(request.app[ACCOUNT_STATE].by_id)
    return collection(
        "#ManagerAccountCollection.ManagerAccountCollection", ACCOUNTS, "Accounts Collection", ids
    )


async def account(request: web.Request) -> web.Response:
    a = request.app[ACCOUNT_STATE].by_id.get(request.match_info["aid"])
    if a is None:
        return _error(404, "ResourceMissingAtURI", f"no account at {request.path}")
    return _json(_body(a))


async def add_account(request: web.Request) -> web.Response:
    state = request.app[ACCOUNT_STATE]
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "MalformedJSON", "the request body is not valid JSON")
    user = body.get("UserName") if isinstance(body, dict) else None
    password = body.get("Password") if isinstance(body, dict) else None
    role = body.get("RoleId", "ReadOnly") if isinstance(body, dict) else None
    if not isinstance(user, str) or not user or not isinstance(password, str):
        return _error(400, "PropertyMissing", "UserName and Password are required")
    if len(password) < 8:
        return _error(400, "PropertyValueFormatError", "the password is too short")
    if role not in ROLE_IDS:
        return _error(400, "PropertyValueNotInList", f"RoleId {role!r}")
    if any(a.user == user for a in state.by_id.values()):
        return _error(409, "ResourceAlreadyExists", f"an account {user!r} exists")
    if len(state.by_id) >= MAX_ACCOUNTS:
        return _error(400, "CreateLimitReachedForResource", "no more accounts")
    a = Account(str(state._next), user, password, role)
    state._next += 1
    state.by_id[a.id] = a
    return _json(_body(a), 201, {"Location": f"{ACCOUNTS}/{a.id}"})


async def delete_account(request: web.Request) -> web.Response:
    state = request.app[ACCOUNT_STATE]
    aid = request.match_info["aid"]
    if aid not in state.by_id:
        return _error(404, "ResourceMissingAtURI", f"no account at {request.path}")
    if aid == "1":
        return _error(400, "ActionNotSupported", "the BMC's own account cannot be removed")
    del state.by_id[aid]
    return web.Response(status=204, headers=ODATA)


async def roles(request: web.Request) -> web.Response:
    return _json(
        {
            "@odata.type": "#RoleCollection.RoleCollection",
            "@odata.id": ROLES,
            "Name": "Roles Collection",
            "Members@odata.count": len(ROLE_IDS),
            "Members": [{"@odata.id": f"{ROLES}/{r}"} for r in ROLE_IDS],
        }
    )


PRIVILEGES = {
    "Administrator": [
        "Login",
        "ConfigureManager",
        "ConfigureUsers",
        "ConfigureSelf",
        "ConfigureComponents",
    ],
    "Operator": ["Login", "ConfigureSelf", "ConfigureComponents"],
    "ReadOnly": ["Login", "ConfigureSelf"],
}


async def role(request: web.Request) -> web.Response:
    rid = request.match_info["rid"]
    if rid not in ROLE_IDS:
        return _error(404, "ResourceMissingAtURI", f"no role at {request.path}")
    return _json(
        {
            "@odata.type": "#Role.v1_3_1.Role",
            "@odata.id": f"{ROLES}/{rid}",
            "Id": rid,
            "Name": f"{rid} Role",
            "RoleId": rid,
            "IsPredefined": True,
            "AssignedPrivileges": PRIVILEGES[rid],
        }
    )


def install(app: web.Application, user: str, password: str) -> Accounts:
    state = app[ACCOUNT_STATE] = Accounts({"1": Account("1", user, password)})
    app.router.add_get(SERVICE, account_service)
    app.router.add_get(ACCOUNTS, accounts)
    app.router.add_post(ACCOUNTS, add_account)
    app.router.add_get(ACCOUNTS + "/{aid}", account)
    app.router.add_delete(ACCOUNTS + "/{aid}", delete_account)
    app.router.add_get(ROLES, roles)
    app.router.add_get(ROLES + "/{rid}", role)
    return state
