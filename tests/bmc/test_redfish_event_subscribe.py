"""The Redfish driver's event subscription against hand-made BMCs: one without an
EventService answers None (polling only); one whose subscription ``Location`` points at another
host is refused, so metald never later sends its credentials there (GET / DELETE of it)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from aiohttp import web

from metald.bmc.base import BmcEndpoint, BmcProtocolError
from metald.bmc.redfish import RedfishDriver
from tests.bmc.peers import free_port


def _bmc(*, events: bool, location: str, seen: list[Any]) -> web.Application:
    async def root(_r: web.Request) -> web.Response:
        body: dict[str, Any] = {"@odata.id": "/redfish/v1/"}
        if events:
            body["EventService"] = {"@odata.id": "/redfish/v1/EventService"}
        return web.json_response(body)

    async def service(_r: web.Request) -> web.Response:
        return web.json_response({
            "ServiceEnabled": True, "EventTypesForSubscription": ["Alert"],
            "Subscriptions": {"@odata.id": "/redfish/v1/EventService/Subscriptions"},
        })  # fmt: skip

    async def subscribe(r: web.Request) -> web.Response:
        seen.append(await r.json())
        return web.json_response({}, status=201, headers={"Location": location})

    app = web.Application()
    app.router.add_get("/redfish/v1/", root)
    app.router.add_get("/redfish/v1/EventService", service)
    app.router.add_post("/redfish/v1/EventService/Subscriptions", subscribe)
    return app


async def _driver(app: web.Application) -> tuple[web.AppRunner, RedfishDriver]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port(socket.SOCK_STREAM)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    d = RedfishDriver(BmcEndpoint("127.0.0.1", port, "u", "p"), scheme="http")
    d._basic = True  # no session login on these hand-made BMCs
    return runner, d


async def test_a_bmc_without_an_event_service_is_polled_only() -> None:
    seen: list[Any] = []
    runner, d = await _driver(_bmc(events=False, location="/x", seen=seen))
    try:
        assert await d.event_subscribe("http://metald/api/v1/bmc-events/b1", "s") is None
        assert seen == []
    finally:
        await d.close()
        await runner.cleanup()


@pytest.mark.parametrize("location", ["http://10.9.9.9/redfish/v1/S/1", "//10.9.9.9/S/1"])
async def test_a_subscription_elsewhere_is_refused(location: str) -> None:
    seen: list[Any] = []
    runner, d = await _driver(_bmc(events=True, location=location, seen=seen))
    try:
        with pytest.raises(BmcProtocolError, match="elsewhere"):
            await d.event_subscribe("http://metald/api/v1/bmc-events/b1", "s3cret")
        (body,) = seen
        assert body["HttpHeaders"] == [{"X-Metald-Event-Secret": "s3cret"}]
        assert body["EventTypes"] == ["Alert"] and body["Protocol"] == "Redfish"
    finally:
        await d.close()
        await runner.cleanup()
