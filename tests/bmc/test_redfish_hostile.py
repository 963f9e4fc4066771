"""A hostile Redfish BMC cannot make the driver send metald's credentials elsewhere.

Two aiohttp servers on loopback: the "BMC", a small but complete Redfish service (service root,
session login, one system with a reset action answered by a task monitor), whose links can be
pointed at the second server, the "collector", which records every request it gets. Whatever
link the BMC bends, the collector must see nothing and the driver must refuse with a sentence.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from metald.bmc.base import BmcEndpoint, BmcProtocolError, PowerAction
from metald.bmc.redfish import RedfishDriver, foreign_urls

PASSWORD = "s3cret-bmc-password"
SYSTEM = "/redfish/v1/Systems/1"


def hostile_bmc(bend: str, elsewhere: str, seen: list[str]) -> web.Application:
    """A Redfish service whose ``bend`` link points to ``elsewhere`` (another origin, or
    "self": an absolute URL of the BMC's own origin)."""

    def link(name: str, path: str, r: web.Request) -> str:
        if bend != name:
            return path
        return (f"http://{r.host}" if elsewhere == "self" else elsewhere) + path

    async def root(r: web.Request) -> web.Response:
        sessions = link("sessions", "/redfish/v1/SessionService/Sessions", r)
        return web.json_response({"Links": {"Sessions": {"@odata.id": sessions}}})

    async def login(r: web.Request) -> web.Response:
        body = await r.json()
        assert body["Password"] == PASSWORD
        where = link("session-location", "/redfish/v1/SessionService/Sessions/7", r)
        return web.json_response({}, status=201, headers={"X-Auth-Token": "tok", "Location": where})

    async def systems(r: web.Request) -> web.Response:
        seen.append(r.headers.get("X-Auth-Token", ""))
        return web.json_response({"Members": [{"@odata.id": link("member", SYSTEM, r)}]})

    async def system(r: web.Request) -> web.Response:
        target = link("action", f"{SYSTEM}/Actions/ComputerSystem.Reset", r)
        return web.json_response(
            {
                "UUID": "u-1",
                "PowerState": "Off",
                "Actions": {"#ComputerSystem.Reset": {"target": target}},
            }
        )

    async def reset(r: web.Request) -> web.Response:
        task = link("task", "/redfish/v1/TaskService/Tasks/1", r)
        return web.json_response({}, status=202, headers={"Location": task})

    async def task(_r: web.Request) -> web.Response:
        return web.json_response({"TaskState": "Completed"})

    async def logout(_r: web.Request) -> web.Response:
        return web.Response(status=204)

    app = web.Application()
    app.router.add_get("/redfish/v1/", root)
    app.router.add_post("/redfish/v1/SessionService/Sessions", login)
    app.router.add_delete("/redfish/v1/SessionService/Sessions/7", logout)
    app.router.add_get("/redfish/v1/Systems", systems)
    app.router.add_get(SYSTEM, system)
    app.router.add_post(f"{SYSTEM}/Actions/ComputerSystem.Reset", reset)
    app.router.add_get("/redfish/v1/TaskService/Tasks/1", task)
    return app


def collector(got: list[dict[str, Any]]) -> web.Application:
    async def record(r: web.Request) -> web.Response:
        got.append({"method": r.method, "path": r.path, "headers": dict(r.headers)})
        got[-1]["body"] = await r.text()
        return web.json_response({}, status=201, headers={"X-Auth-Token": "stolen"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    return app


async def _exercise(d: RedfishDriver) -> None:
    try:
        await d.set_power(PowerAction.ON)
    finally:
        await d.close()


@pytest.mark.parametrize(
    ("bend", "form"),
    [
        ("sessions", "absolute"),  # the login body (with the password) would go there
        ("member", "absolute"),  # X-Auth-Token
        ("action", "absolute"),
        ("task", "absolute"),  # a 202's Location
        ("session-location", "absolute"),  # the logout DELETE carries the token
        ("member", "same-host-other-port"),
        ("sessions", "userinfo"),
        ("member", "scheme-relative"),
    ],
)
async def test_links_off_the_bmc_are_never_followed(bend: str, form: str) -> None:
    got: list[dict[str, Any]] = []
    seen: list[str] = []
    async with TestServer(collector(got), host="127.0.0.1") as other:
        elsewhere = {
            "absolute": f"http://127.0.0.1:{other.port}",
            "same-host-other-port": f"http://127.0.0.1:{other.port}",
            "userinfo": f"http://127.0.0.1:0@127.0.0.1:{other.port}",
            "scheme-relative": f"//127.0.0.1:{other.port}",
        }[form]
        async with TestServer(hostile_bmc(bend, elsewhere, seen), host="127.0.0.1") as bmc:
            ep = BmcEndpoint("127.0.0.1", bmc.port, "admin", PASSWORD)
            d = RedfishDriver(ep, scheme="http", request_timeout_s=5.0, task_poll_s=0.01)
            before = foreign_urls._value.get()
            if bend == "session-location":
                await _exercise(d)  # everything on the BMC works; only the logout is refused
            else:
                with pytest.raises(BmcProtocolError, match="link off the BMC"):
                    await _exercise(d)
            assert foreign_urls._value.get() == before + 1
    assert got == []  # the other server never saw a request, let alone the password


@pytest.mark.parametrize("bend", ["sessions", "member", "action", "task", "session-location"])
async def test_same_origin_absolute_links_are_followed(bend: str) -> None:
    """Absolute URLs of the BMC's own scheme, host and port are ordinary Redfish: they work."""
    seen: list[str] = []
    async with TestServer(hostile_bmc(bend, "self", seen), host="127.0.0.1") as bmc:
        ep = BmcEndpoint("127.0.0.1", bmc.port, "admin", PASSWORD)
        d = RedfishDriver(ep, scheme="http", request_timeout_s=5.0, task_poll_s=0.01)
        before = foreign_urls._value.get()
        await _exercise(d)
        assert foreign_urls._value.get() == before
    assert seen == ["tok"]
