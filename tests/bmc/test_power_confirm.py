"""Confirmed power (issue 16, item 1): a power action answers what the BMC reports, not what
was asked. Against sushy-emulator applying power changes seconds after it accepted them, as
the stock emulator and real BMCs do."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from sqlmodel import select

from metald.config import Config
from metald.store import Store
from metald.store.models import Event, Machine
from tests.api_helpers import link_redfish
from tests.bmc.peers import Sushy


@pytest.fixture
def bmc_settings() -> dict[str, Any]:
    return {"power_state_timeout_s": 30}


async def _bmc_says(peer: Sushy) -> str:
    """The power state straight from the emulator, independent of metald."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{peer.port}/redfish/v1/Systems/{peer.system_uuid}") as r,
    ):
        return (await r.json())["PowerState"]


async def _until_done(client, tokens, mid: str, command_id: str) -> dict:  # type: ignore[no-untyped-def]
    url = f"/api/v1/machines/{mid}/power/commands/{command_id}"
    async with asyncio.timeout(60):
        while True:
            r = await client.get(url, headers=tokens.header("technician"))
            assert r.status == 200, await r.text()
            cmd = await r.json()
            if cmd["status"] != "pending":
                return cmd
            await asyncio.sleep(0.1)


async def _recorded(store: Store, mid: str) -> str | None:
    return await store.run(lambda s: s.get(Machine, mid).power_state)


async def _events(store: Store, kind: str) -> list[Event]:
    return await store.run(lambda s: list(s.exec(select(Event).where(Event.kind == kind)).all()))


@pytest.mark.parametrize("sushy_slow", [2], indirect=True)
async def test_power_on_answers_the_state_the_bmc_reports(
    bmc_api, store: Store, sushy_slow
) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = bmc_api
    mid = await link_redfish(client, tokens, sushy_slow.port)
    r = await client.post(
        f"/api/v1/machines/{mid}/power", json={"action": "on"}, headers=tokens.header("technician")
    )
    assert r.status == 200, await r.text()
    out = await r.json()
    # The answer is what the BMC says now, read independently of metald.
    assert await _bmc_says(sushy_slow) == "On"
    assert out["power_state"] == "on" and out["status"] == "confirmed"
    assert out["target_state"] == "on" and out["command_id"]
    assert await _recorded(store, mid) == "on"
    (ev,) = await _events(store, "bmc.power")
    assert ev.data["command_id"] == out["command_id"] and ev.data["status"] == "confirmed"


@pytest.mark.parametrize("sushy_slow", [8], indirect=True)  # long enough to look first
async def test_past_the_wait_202_then_confirmed_in_the_background(
    bmc_api, store: Store, sushy_slow
) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = bmc_api
    mid = await link_redfish(client, tokens, sushy_slow.port)
    r = await client.post(
        f"/api/v1/machines/{mid}/power",
        json={"action": "on", "wait_s": 0},
        headers=tokens.header("technician"),
    )
    assert r.status == 202, await r.text()
    out = await r.json()
    assert out["status"] == "pending" and out["command_id"]
    # Recorded: what the BMC said (nothing yet, or off), never the state asked for.
    assert await _recorded(store, mid) in (None, "off")
    assert await _bmc_says(sushy_slow) == "Off"

    done = await _until_done(client, tokens, mid, out["command_id"])
    assert done["status"] == "confirmed" and done["power_state"] == "on"
    assert await _bmc_says(sushy_slow) == "On"
    assert await _recorded(store, mid) == "on"
    (ev,) = await _events(store, "bmc.power-confirmed")
    assert ev.machine_id == mid and ev.data["command_id"] == out["command_id"]

    r = await client.get(
        f"/api/v1/machines/{mid}/power/commands/no-such", headers=tokens.header("technician")
    )
    assert r.status == 404 and "events" in (await r.json())["detail"]


@pytest.mark.parametrize("sushy_slow", [3600], indirect=True)
async def test_a_bmc_that_never_gets_there_is_an_error_event(
    bmc_api, store: Store, sushy_slow, cfg: Config
) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = bmc_api
    cfg.bmc.power_state_give_up_s = 1.0
    mid = await link_redfish(client, tokens, sushy_slow.port)
    r = await client.post(
        f"/api/v1/machines/{mid}/power",
        json={"action": "on", "wait_s": 0},
        headers=tokens.header("technician"),
    )
    assert r.status == 202, await r.text()
    out = await r.json()
    done = await _until_done(client, tokens, mid, out["command_id"])
    assert done["status"] == "failed" and done["power_state"] == "off"
    (ev,) = await _events(store, "bmc.power-failed")
    assert ev.machine_id == mid and "did not report power on" in ev.reason
    assert await _recorded(store, mid) == "off"
    assert not await _events(store, "bmc.power-confirmed")

    # Waiting in the request for a BMC that never gets there: a 502 naming the command.
    r = await client.post(
        f"/api/v1/machines/{mid}/power",
        json={"action": "on"},
        headers=tokens.header("technician"),
    )
    assert r.status == 502, await r.text()
    problem = await r.json()
    assert problem["command_id"] and "did not report power on" in problem["detail"]
    assert await _recorded(store, mid) == "off"
