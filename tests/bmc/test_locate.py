"""Locate (issue 16, item 6): the chassis identify light, through IPMI against OpenIPMI's
ipmi_sim and through Redfish IndicatorLED against sushy-emulator, then over the API."""

from __future__ import annotations

from sqlmodel import select

from metald.bmc.base import BmcEndpoint
from metald.bmc.ipmi import IpmiDriver
from metald.bmc.redfish import RedfishDriver
from metald.store import Store
from metald.store.models import Event
from tests.api_helpers import link_redfish
from tests.bmc.peers import IpmiSim, Sushy
from tests.bmc.test_bmc_redfish import _system_json


async def test_redfish_indicator_led_on_and_off(sushy: Sushy) -> None:
    d = RedfishDriver(
        BmcEndpoint("127.0.0.1", sushy.port, "admin", "unused"), scheme="http", request_timeout_s=5
    )
    try:
        await d.set_locate(True)
        assert (await _system_json(sushy))["IndicatorLED"] == "Lit"
        assert await d.get_locate() is True
        await d.set_locate(False)
        assert (await _system_json(sushy))["IndicatorLED"] == "Off"
        assert await d.get_locate() is False
    finally:
        await d.close()


async def test_ipmi_chassis_identify_on_and_off(ipmi_sim: IpmiSim) -> None:
    ep = BmcEndpoint("127.0.0.1", ipmi_sim.port, ipmi_sim.username, ipmi_sim.password)
    d = IpmiDriver(ep, request_timeout_s=5.0, resend_s=0.3)
    try:
        await d.set_locate(True)
        on = await d.get_locate()
        await d.set_locate(False)
        off = await d.get_locate()
    finally:
        await d.close()
    # ipmi_sim hands Chassis Identify to its chassis script as "set identify INTERVAL FORCE":
    # force on (until turned off), then off.
    assert [c for c in ipmi_sim.calls() if "identify" in c] == [
        "set identify 0 1",
        "set identify 0 0",
    ]
    # Its chassis status does not say (bit 6 of byte 3 clear): unknown, not a guess.
    assert (on, off) == (None, None)


async def test_locate_over_the_api_with_an_event_naming_who(
    bmc_api, store: Store, sushy: Sushy
) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = bmc_api
    tech = tokens.header("technician")
    mid = await link_redfish(client, tokens, sushy.port)
    r = await client.put(f"/api/v1/machines/{mid}/locate", json={"on": True}, headers=tech)
    assert r.status == 200, await r.text()
    assert (await r.json())["on"] is True
    assert (await _system_json(sushy))["IndicatorLED"] == "Lit"
    r = await client.get(f"/api/v1/machines/{mid}/locate", headers=tech)
    assert (await r.json())["on"] is True
    r = await client.put(f"/api/v1/machines/{mid}/locate", json={"on": False}, headers=tech)
    assert (await r.json())["on"] is False
    assert (await _system_json(sushy))["IndicatorLED"] == "Off"
    r = await client.put(f"/api/v1/machines/{mid}/locate", json={"on": "yes"}, headers=tech)
    assert r.status == 422
    events = await store.run(
        lambda s: list(s.exec(select(Event).where(Event.kind == "bmc.locate")).all())
    )
    assert [e.data["on"] for e in events] == [True, False]
    assert all(e.actor and e.actor != "system" for e in events)
    r = await client.put(
        f"/api/v1/machines/{mid}/locate", json={"on": True}, headers=tokens.header("orchestrator")
    )
    assert r.status == 403
