"""Two instances on one store: a console opened on the instance that does not own the BMC is
carried to the owner (the one that holds SOL), with the caller's token checked there too."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from metald.bmc.console import ConsoleService
from metald.bmc.console_links import BmcLinks
from metald.bmc.service import BmcService
from metald.config import Config
from metald.fleet.membership import Membership
from metald.secrets import SecretBox
from metald.store import Store
from tests.bmc.peers import PASSWORD
from tests.bmc.test_sol_ipmi_sim import SolSim, running_sol_sim
from tests.conftest import seed


@pytest.fixture
async def sim(tmp_path: Path) -> AsyncIterator[SolSim]:
    async with running_sol_sim(tmp_path) as s:
        yield s


async def _instance(
    name: str, cfg: Config, store: Store, bmc_networks: list[str]
) -> tuple[TestServer, Membership, list[Any]]:
    from api.app import create_app
    from api.context import AppContext, Services
    from metald.events import EventBus

    secrets = SecretBox.from_file(cfg.secrets_key_path)
    cfg = cfg.model_copy(deep=True)
    cfg.instance = name
    cfg.bmc.min_interval_ms = 0
    cfg.bmc.timeout_s = 3
    bmc = BmcService(store, secrets, cfg.bmc, name)
    consoles = ConsoleService(store, name, BmcLinks(bmc, secrets), linger_s=0.0)
    ctx = AppContext(
        cfg=cfg,
        store=store,
        secrets=secrets,
        bus=EventBus(),
        services=Services(bmc=bmc, console=consoles),
    )
    server = TestServer(create_app(ctx), host="127.0.0.1")
    await server.start_server()
    fleet = Membership(
        store,
        name,
        heartbeat_s=0.5,
        dead_after_s=30,
        api_url=str(server.make_url("")),
        serves={"bmc_networks": bmc_networks},
    )
    bmc.ownership = fleet
    await fleet.start()
    return server, fleet, [consoles, bmc]


async def register_sim_bmc(
    http: aiohttp.ClientSession, owner: TestServer, sim: SolSim, mid: str, headers: dict[str, str]
) -> None:
    """Register the SOL simulator's IPMI BMC for machine ``mid`` at the ``owner`` instance."""
    body = {
        "address": "127.0.0.1",
        "port": sim.port,
        "protocol": "ipmi",
        "username": "admin",
        "password": PASSWORD,
        "machine_id": mid,
    }
    async with http.post(owner.make_url("/api/v1/bmcs"), json=body, headers=headers) as r:
        assert r.status == 201, await r.text()


async def both_ways(
    ws: aiohttp.ClientWebSocketResponse, sim: SolSim, from_serial: bytes, typed: bytes
) -> None:
    """A writer's console: hello, the SOL link connected, ``from_serial`` sent on the serial
    line arrives, and ``typed`` reaches the serial line."""
    hello = json.loads((await ws.receive()).data)
    assert hello["type"] == "hello" and hello["mode"] == "write", hello
    async with asyncio.timeout(15):
        while True:
            m = await ws.receive()
            if m.type == aiohttp.WSMsgType.TEXT and "connected" in m.data:
                break
    await sim.serial.send(from_serial)
    seen = b""
    async with asyncio.timeout(15):
        while from_serial not in seen:
            m = await ws.receive()
            assert m.type in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT), m
            if m.type == aiohttp.WSMsgType.BINARY:
                seen += m.data
    await ws.send_bytes(typed)
    await sim.serial.wait_for(typed)


async def test_a_console_on_a_non_owner_is_carried_to_the_owner(
    cfg: Config, store: Store, sim: SolSim
) -> None:
    tokens = seed(store)
    owner, fa, sa = await _instance("rack-a", cfg, store, ["127.0.0.0/8"])
    other, fb, sb = await _instance("rack-b", cfg, store, ["192.0.2.0/24"])
    try:
        await fa.refresh()
        await fb.refresh()
        tech = tokens.header("technician")
        mid = tokens.machine_free
        async with aiohttp.ClientSession() as http:
            await register_sim_bmc(http, owner, sim, mid, tech)

            url = other.make_url(f"/api/v1/machines/{mid}/console")
            async with http.ws_connect(url, headers=tech) as ws:
                await both_ways(ws, sim, b"via-the-owner", b"typed-at-b")
            # The SOL link lives on the owner, not on the instance the client called.
            assert mid in sa[0].consoles and mid not in sb[0].consoles

            # The owner authorizes again: an orchestrator is refused there as here.
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await http.ws_connect(url, headers=tokens.header("orchestrator"))
            assert e.value.status == 403
    finally:
        for f, services, server in ((fb, sb, other), (fa, sa, owner)):
            for s in services:
                await s.stop()
            await f.stop()
            await server.close()
