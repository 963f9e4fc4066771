"""The BMC routes over HTTP, with a real BmcService behind them and ipmi_sim as the BMC."""

from __future__ import annotations

import pytest

from metald.bmc.service import BmcService
from metald.config import Config
from metald.secrets import SecretBox
from metald.store import Store
from tests.bmc.peers import IpmiSim, free_port
from tests.conftest import seed


@pytest.fixture
async def bmc_api(cfg: Config, store: Store, aiohttp_client):  # type: ignore[no-untyped-def]
    from api.app import create_app
    from api.context import AppContext, Services
    from metald.events import EventBus

    secrets = SecretBox.from_file(cfg.secrets_key_path)
    cfg.bmc.min_interval_ms = 0
    cfg.bmc.timeout_s = 3
    cfg.bmc.retries = 1
    # A refused registration answers at verify_s whatever failed (no timing oracle): short
    # here, where ipmi_sim answers on loopback in milliseconds.
    cfg.bmc.verify_s = 2.5
    svc = BmcService(store, secrets, cfg.bmc, cfg.instance)
    ctx = AppContext(
        cfg=cfg, store=store, secrets=secrets, bus=EventBus(), services=Services(bmc=svc)
    )
    tokens = seed(store)
    client = await aiohttp_client(create_app(ctx))
    yield client, tokens
    await svc.stop()


def _ipmi_body(ipmi_sim: IpmiSim, machine_id: str) -> dict[str, object]:
    return {
        "address": "127.0.0.1",
        "port": ipmi_sim.port,
        "protocol": "ipmi",
        "username": "admin",
        "password": ipmi_sim.password,
        "machine_id": machine_id,
    }


IPMI_CAPABILITIES = ["boot-device", "event-log", "indicator", "power", "sensors", "serial-console"]


async def test_a_bmc_shows_its_capabilities_and_one_it_lacks_is_refused_by_name(
    bmc_api, ipmi_sim: IpmiSim
) -> None:  # type: ignore[no-untyped-def]
    client, tokens = bmc_api
    tech = tokens.header("technician")
    mid = tokens.machine_free
    body = _ipmi_body(ipmi_sim, mid)
    r = await client.post("/api/v1/bmcs", json=body, headers=tech)
    assert r.status == 201, await r.text()
    bmc = await r.json()
    assert bmc["capabilities"] == IPMI_CAPABILITIES
    r = await client.get(f"/api/v1/bmcs/{bmc['id']}", headers=tech)
    assert (await r.json())["capabilities"] == IPMI_CAPABILITIES
    r = await client.get("/api/v1/bmcs", headers=tech)
    assert [b["capabilities"] for b in (await r.json())["items"]] == [IPMI_CAPABILITIES]
    spec = (await (await client.get("/api/v1/openapi.json")).json())["components"]["schemas"]
    assert "capabilities" in spec["BmcOut"]["properties"]

    sent = ipmi_sim.calls()
    for method, path, payload, capability in [
        ("GET", f"/api/v1/machines/{mid}/firmware", None, "firmware"),
        ("GET", f"/api/v1/machines/{mid}/bios", None, "bios"),
        ("PUT", f"/api/v1/machines/{mid}/bios", {"attributes": {"BootMode": "Uefi"}}, "bios"),
    ]:
        r = await client.request(method, path, json=payload, headers=tech)
        assert r.status == 422, await r.text()
        assert r.content_type == "application/problem+json"
        problem = await r.json()
        assert problem["capability"] == capability
        assert f"no {capability} capability" in problem["detail"]
        assert problem["bmc_id"] == bmc["id"]
    assert ipmi_sim.calls() == sent  # refused before anything reached the BMC


async def test_register_power_boot_sensors_over_http(bmc_api, ipmi_sim: IpmiSim) -> None:  # type: ignore[no-untyped-def]
    client, tokens = bmc_api
    tech = tokens.header("technician")
    mid = tokens.machine_free
    body = _ipmi_body(ipmi_sim, mid)
    r = await client.post("/api/v1/bmcs", json=body, headers=tech)
    text = await r.text()
    assert r.status == 201, text
    assert ipmi_sim.password not in text
    bmc = await r.json()
    assert bmc["machine_id"] == mid and bmc["health"] == "ok"

    r = await client.get("/api/v1/bmcs", headers=tech)
    listing = await r.text()
    assert r.status == 200 and ipmi_sim.password not in listing
    assert [b["id"] for b in (await r.json())["items"]] == [bmc["id"]]

    r = await client.post(f"/api/v1/machines/{mid}/power", json={"action": "on"}, headers=tech)
    assert r.status == 200, await r.text()
    assert (await r.json())["power_state"] == "on"
    r = await client.get(f"/api/v1/machines/{mid}/power", headers=tech)
    assert (await r.json())["power_state"] == "on"
    r = await client.put(
        f"/api/v1/machines/{mid}/boot-device",
        json={"device": "pxe", "persistent": False, "uefi": True},
        headers=tech,
    )
    assert r.status == 200, await r.text()
    assert "set power 1" in ipmi_sim.calls() and "set boot pxe" in ipmi_sim.calls()

    r = await client.get(f"/api/v1/machines/{mid}/sensors", headers=tech)
    assert r.status == 200, await r.text()
    assert any(s["name"] == "CPU Temp" and s["units"] for s in (await r.json())["items"])
    r = await client.get(f"/api/v1/machines/{mid}/bmc-log", headers=tech)
    assert len((await r.json())["items"]) == 1

    # Orchestrators and agents do not drive BMCs.
    r = await client.post(
        f"/api/v1/machines/{mid}/power", json={"action": "off"}, headers=tokens.header("agent")
    )
    assert r.status == 403


async def test_errors_are_problems_without_secrets(bmc_api, ipmi_sim: IpmiSim) -> None:  # type: ignore[no-untyped-def]
    client, tokens = bmc_api
    tech = tokens.header("technician")
    wrong = {
        "address": "127.0.0.1",
        "port": ipmi_sim.port,
        "protocol": "ipmi",
        "username": "admin",
        "password": "Wrong-Pass-77",
    }
    r = await client.post("/api/v1/bmcs", json=wrong, headers=tech)
    text = await r.text()
    assert r.status == 422 and "the login step did not succeed" in text
    assert "Wrong-Pass-77" not in text
    assert r.headers["Content-Type"].startswith("application/problem+json")

    too_long = {**wrong, "password": "X" * 300 + "Secret-Tail"}
    r = await client.post("/api/v1/bmcs", json=too_long, headers=tech)
    assert r.status == 422 and "Secret-Tail" not in await r.text()

    dead = {**wrong, "port": free_port(), "password": "x"}
    r = await client.post("/api/v1/bmcs", json=dead, headers=tech)
    assert r.status == 422 and "could not verify the BMC" in (await r.json())["detail"]

    r = await client.post(
        f"/api/v1/machines/{tokens.machine_a}/power", json={"action": "on"}, headers=tech
    )
    assert r.status == 404 and "has no BMC" in (await r.json())["detail"]
    r = await client.post(
        f"/api/v1/machines/{tokens.machine_a}/power", json={"action": "explode"}, headers=tech
    )
    assert r.status == 422


async def test_without_the_service_routes_answer_503(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    r = await client.get("/api/v1/bmcs", headers=tokens.header("admin"))
    assert r.status == 503
    assert "not running" in (await r.json(content_type=None))["detail"]


async def test_the_machine_page_offers_only_what_the_bmc_can_do(bmc_api, store: Store) -> None:  # type: ignore[no-untyped-def]
    from metald.store.models import Bmc

    client, tokens = bmc_api
    rows = {
        tokens.machine_a: Bmc(
            machine_id=tokens.machine_a, address="192.0.2.1", protocol="ipmi", username="u",
            password_enc=b"x",
        ),
        tokens.machine_b: Bmc(
            machine_id=tokens.machine_b, address="192.0.2.2", protocol="redfish", username="u",
            password_enc=b"x",
        ),
    }  # fmt: skip

    def add(s) -> None:  # type: ignore[no-untyped-def]
        s.add_all(rows.values())
        s.commit()

    await store.run(add)
    origin = str(client.make_url("/")).rstrip("/")
    r = await client.post(
        "/ui/login",
        data={"token": tokens.admin},
        headers={"Origin": origin},
        allow_redirects=False,
    )
    assert r.status == 303, await r.text()
    ipmi = await (await client.get(f"/ui/machines/{tokens.machine_a}")).text()
    redfish = await (await client.get(f"/ui/machines/{tokens.machine_b}")).text()
    assert "boot-device, event-log, indicator, power, sensors, serial-console" in ipmi
    assert "Open console" in ipmi and "Read sensors" in ipmi
    assert "virtual-media" in redfish and "serial-console" not in redfish
    assert "Open console" not in redfish and "Read sensors" in redfish
