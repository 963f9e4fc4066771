"""A hostile BMC's update answers: a task named off the BMC is refused before anything is
sent there, odd progress values are bounded, and an endless task list is read only in part."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from metald.bmc.base import BmcEndpoint, BmcProtocolError
from metald.bmc.redfish import MAX_TASKS, RedfishDriver


def _app(seen: list[str], location: str, percent: Any = 5) -> web.Application:
    async def root(_: web.Request) -> web.Response:
        return web.json_response(
            {"UpdateService": {"@odata.id": "/redfish/v1/UpdateService"},
             "Tasks": {"@odata.id": "/redfish/v1/TaskService"}}
        )  # fmt: skip

    async def update(_: web.Request) -> web.Response:
        return web.json_response(
            {"FirmwareInventory": {"@odata.id": "/redfish/v1/UpdateService/FirmwareInventory"},
             "Actions": {"#UpdateService.SimpleUpdate": {"target": "/redfish/v1/UpdateService/Actions/SimpleUpdate"}}}
        )  # fmt: skip

    async def inventory(_: web.Request) -> web.Response:
        return web.json_response(
            {"Members": [{"@odata.id": "/redfish/v1/UpdateService/FirmwareInventory/BIOS"}]}
        )

    async def simple(_: web.Request) -> web.Response:
        return web.json_response({}, status=202, headers={"Location": location})

    async def task_service(_: web.Request) -> web.Response:
        return web.json_response({"Tasks": {"@odata.id": "/redfish/v1/TaskService/Tasks"}})

    async def tasks(_: web.Request) -> web.Response:
        members = [{"@odata.id": f"/redfish/v1/TaskService/Tasks/{i}"} for i in range(10_000)]
        return web.json_response({"Members": members})

    async def task(request: web.Request) -> web.Response:
        return web.json_response(
            {"TaskState": "Running", "PercentComplete": percent,
             "Payload": {"JsonBody": "x"}, "Messages": [{"Message": "m" * 10_000}]}
        )  # fmt: skip

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        seen.append(request.path)
        return await handler(request)

    app = web.Application(middlewares=[record])
    app.router.add_get("/redfish/v1/", root)
    app.router.add_get("/redfish/v1/UpdateService", update)
    app.router.add_get("/redfish/v1/UpdateService/FirmwareInventory", inventory)
    app.router.add_post("/redfish/v1/UpdateService/Actions/SimpleUpdate", simple)
    app.router.add_get("/redfish/v1/TaskService", task_service)
    app.router.add_get("/redfish/v1/TaskService/Tasks", tasks)
    app.router.add_get("/redfish/v1/TaskService/Tasks/{n}", task)
    return app


async def _driver(aiohttp_server: Any, app: web.Application) -> RedfishDriver:
    server = await aiohttp_server(app)
    return RedfishDriver(BmcEndpoint("127.0.0.1", server.port, "u", "p"), scheme="http")


async def test_task_off_the_bmc_is_refused(aiohttp_server: Any) -> None:
    seen: list[str] = []
    d = await _driver(aiohttp_server, _app(seen, "http://192.0.2.1/steal"))
    try:
        with pytest.raises(BmcProtocolError, match="named a task off the BMC"):
            await d.simple_update("http://metald/boot/firmware/x.bin", "BIOS")
    finally:
        await d.close()


async def test_progress_bounded_and_task_list_cut(aiohttp_server: Any) -> None:
    seen: list[str] = []
    d = await _driver(aiohttp_server, _app(seen, "/redfish/v1/TaskService/Tasks/1", percent=1000))
    try:
        t = await d.update_task("/redfish/v1/TaskService/Tasks/1")
        assert t.percent == 100 and len(t.messages[0]) <= 200
        assert await d.find_update_task("not-there") is None
        assert sum(p.startswith("/redfish/v1/TaskService/Tasks/") for p in seen) == MAX_TASKS + 1
    finally:
        await d.close()
