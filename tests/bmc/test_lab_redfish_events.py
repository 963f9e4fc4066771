"""The lab Redfish BMC's EventService: a subscription gets a standard Event for each log entry
added, with its headers and Context; the entry is in the log metald's driver reads; DELETE and
a BMC restart end subscriptions; bad subscriptions are refused."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import aiohttp
from aiohttp import web

from metald.bmc.base import BmcEndpoint
from metald.bmc.redfish import RedfishDriver
from tests.bmc.peers import LabRedfish, free_port
from vmlab import redfish_events


async def _receiver() -> tuple[web.AppRunner, str, list[tuple[dict[str, str], Any]]]:
    got: list[tuple[dict[str, str], Any]] = []

    async def take(request: web.Request) -> web.Response:
        got.append((dict(request.headers), await request.json()))
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/events", take)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port(socket.SOCK_STREAM)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/events", got


async def _until(cond: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.02)


async def test_a_log_entry_is_pushed_to_each_subscription(lab_redfish: LabRedfish) -> None:
    runner, dest, got = await _receiver()
    base = f"http://127.0.0.1:{lab_redfish.port}"
    auth = {"Authorization": aiohttp.encode_basic_auth(lab_redfish.username, lab_redfish.password)}
    d = RedfishDriver(
        BmcEndpoint("127.0.0.1", lab_redfish.port, lab_redfish.username, lab_redfish.password),
        scheme="http",
    )
    try:
        async with aiohttp.ClientSession(base, headers=auth) as http:
            root = await (await http.get("/redfish/v1/")).json()
            assert root["EventService"]["@odata.id"] == redfish_events.SERVICE
            svc = await (await http.get(redfish_events.SERVICE)).json()
            assert svc["ServiceEnabled"] and "Alert" in svc["EventTypesForSubscription"]
            r = await http.post(redfish_events.SUBSCRIPTIONS, json={
                "Destination": dest, "Protocol": "Redfish", "EventTypes": ["Alert"],
                "Context": "ctx-1", "HttpHeaders": [{"X-Metald-Event-Secret": "s3cret"}],
            })  # fmt: skip
            assert r.status == 201
            loc = r.headers["Location"]
            shown = await (await http.get(loc)).json()
            assert shown["Destination"] == dest and shown["HttpHeaders"] == []  # never shown
            bad = await http.post(redfish_events.SUBSCRIPTIONS, json={"Destination": "ftp://x"})
            assert bad.status == 400

            entry = lab_redfish.app[redfish_events.EVENTS].add(
                "Memory #0x01 Uncorrectable ECC | Asserted"
            )
            await _until(lambda: len(got) == 1)
            headers, body = got[0]
            assert headers["X-Metald-Event-Secret"] == "s3cret"
            assert body["@odata.type"].startswith("#Event.v1_")
            assert body["Context"] == "ctx-1"
            (ev,) = body["Events"]
            assert ev["EventType"] == "Alert" and ev["Severity"] == "Critical"
            assert ev["Message"] == "Memory #0x01 Uncorrectable ECC | Asserted"
            assert ev["OriginOfCondition"]["@odata.id"].endswith(f"/Entries/{entry.id}")
            assert ev["MessageId"] and ev["EventTimestamp"]

            # the same entry, in the log the driver polls
            (polled,) = await d.event_log()
            assert (polled.id, polled.severity, polled.message) == (
                entry.id, "critical", "Memory #0x01 Uncorrectable ECC | Asserted"
            )  # fmt: skip

            # the lab-only POST adds an entry too
            r = await http.post(redfish_events.ENTRIES,
                                json={"Message": "PSU 1 failure", "Severity": "Critical"})  # fmt: skip
            assert r.status == 201
            await _until(lambda: len(got) == 2)

            assert (await http.delete(loc)).status == 204
            assert (await http.get(loc)).status == 404
            lab_redfish.app[redfish_events.EVENTS].add("after the delete")
            await lab_redfish.app[redfish_events.EVENTS].idle()
            assert len(got) == 2

            # a BMC restart loses its subscriptions
            r = await http.post(redfish_events.SUBSCRIPTIONS, json={"Destination": dest})
            assert r.status == 201
            reset = await http.post("/redfish/v1/Managers/BMC/Actions/Manager.Reset",
                                    json={"ResetType": "GracefulRestart"})  # fmt: skip
            assert reset.status == 204
            assert lab_redfish.app[redfish_events.EVENTS].subscriptions == {}
    finally:
        await d.close()
        await runner.cleanup()
