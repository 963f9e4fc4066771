"""Virtual media boot (issue 16 item 3) against sushy-emulator, whose VirtualMedia insert
really downloads the image: ``POST /api/v1/machines/{id}/boot {"via": "virtual-media"}`` runs
the network-boot step (fenced, journaled: confirmed power-off, insert metald's ISO,
one-time CD boot, arm, power on), and the claim workflow's boot takes the same path for a
machine labelled ``boot-via=virtual-media``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from sqlmodel import select

from metald import machines
from metald.bmc import media as virtual_media
from metald.config import Config
from metald.lifecycle import Trigger
from metald.provision import media_boot, netboot
from metald.store import Store
from metald.store.models import Bmc, Event, Machine
from tests.api_helpers import drain_steps, link_redfish
from tests.bmc.peers import Sushy
from tests.bmc.test_bmc_redfish import _system_json
from tests.conftest import seed

ISO = b"CD001" + bytes(2043) * 16


@pytest.fixture
async def boot_http() -> AsyncIterator[tuple[str, list[str]]]:
    """A boot HTTP listener serving an ISO at the per-boot URLs metald's serves."""
    fetched: list[str] = []

    async def serve(request: web.Request) -> web.Response:
        fetched.append(request.path)
        return web.Response(body=ISO, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/boot/n/{machine}/{nonce}.iso", serve)  # metald's per-boot ISO URLs
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", fetched
    await runner.cleanup()


@pytest.fixture
def bmc_settings() -> dict[str, Any]:
    return {"timeout_s": 10}


@pytest.fixture
def api(bmc_api, boot_http):  # type: ignore[no-untyped-def]
    """``bmc_api``, its BMCs fetching boot ISOs from ``boot_http``."""
    bmc_api[2].control.vmedia_base = boot_http[0]
    return bmc_api


async def _cd(sushy: Sushy) -> dict:  # type: ignore[type-arg]
    import aiohttp

    base = f"http://127.0.0.1:{sushy.port}"
    async with aiohttp.ClientSession() as http:
        system = await _system_json(sushy)
        coll = system["VirtualMedia"]["@odata.id"] if "VirtualMedia" in system else None
        if coll is None:
            async with http.get(base + "/redfish/v1/Managers") as r:
                mgr = (await r.json())["Members"][0]["@odata.id"]
            async with http.get(base + mgr) as r:
                coll = (await r.json())["VirtualMedia"]["@odata.id"]
        async with http.get(base + coll) as r:
            members = (await r.json())["Members"]
        for m in members:
            async with http.get(base + m["@odata.id"]) as r:
                res = await r.json()
            if "CD" in res.get("MediaTypes", []):
                return res
    raise AssertionError("sushy offers no virtual CD")


def _provision(store: Store, mid: str) -> None:
    with store.session() as s:
        machines.transition(s, mid, Trigger.PROVISION, actor="test")


async def test_boot_via_virtual_media_inserts_boots_cd_once_arms_and_powers_on(
    api, store: Store, sushy: Sushy, boot_http
) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _svc = api
    base, fetched = boot_http
    mid = tokens.machine_a
    await link_redfish(client, tokens, sushy.port, mid)
    r = await client.post(  # a tenant's OS running: the boot must take it down first
        f"/api/v1/machines/{mid}/power", json={"action": "on"}, headers=tokens.header("admin")
    )
    assert r.status == 200, await r.text()
    _provision(store, mid)
    with store.session() as s:  # entering provisioning armed one boot: clear it to see ours
        m = s.get(Machine, mid)
        m.boot_armed = None
        s.add(m)
        s.commit()

    r = await client.post(
        f"/api/v1/machines/{mid}/boot",
        json={"via": "virtual-media"},
        headers=tokens.header("technician"),
    )
    assert r.status == 202, await r.text()
    prefix = f"{base}/boot/n/{mid}/"
    assert (await r.json())["image_url"] == prefix
    await drain_steps(client)

    with store.session() as s:
        armed = s.get(Machine, mid).boot_armed
    url = media_boot.iso_url(base, mid, armed)  # the armed boot's own nonce URL
    assert url.startswith(prefix)
    cd = await _cd(sushy)
    assert cd["Inserted"] is True and cd["Image"] == url
    assert fetched == [url.removeprefix(base)]  # sushy fetched it itself
    system = await _system_json(sushy)
    assert system["Boot"]["BootSourceOverrideTarget"] == "Cd"
    # (sushy's template always answers BootSourceOverrideEnabled "Continuous": Once is sent,
    # not observable there.)
    assert system["PowerState"] == "On"
    with store.session() as s:
        m = s.get(Machine, mid)
        assert m.state == "provisioning" and m.boot_armed  # the first script gets the token
        bmc = s.exec(select(Bmc).where(Bmc.machine_id == mid)).one()
        assert bmc.step_done is True
        notes = s.exec(select(Event).where(Event.kind == netboot.NETWORK_BOOT_EVENT)).all()
        assert any("one-time CD boot" in (e.reason or "") for e in notes)
        steps = [
            e.kind if e.kind != "bmc.power" else f"power:{e.data['action']}:{e.data['status']}"
            for e in s.exec(select(Event).order_by(Event.id)).all()  # type: ignore[arg-type]
            if e.kind in ("bmc.power", netboot.NETWORK_BOOT_EVENT)
        ]
    # Confirmed off before the boot was armed, on after: what the tenant ran is gone first.
    assert steps == [
        "power:on:confirmed",
        "power:off:confirmed",
        netboot.NETWORK_BOOT_EVENT,
        "power:on:confirmed",
    ]

    await virtual_media.eject_for(_svc.control, mid)
    assert (await _cd(sushy))["Inserted"] is False


async def test_claim_workflow_boot_takes_virtual_media_when_the_machine_says_so(
    api, store: Store, sushy: Sushy, boot_http
) -> None:  # type: ignore[no-untyped-def]
    client, tokens, svc = api
    mid = tokens.machine_a
    await link_redfish(client, tokens, sushy.port, mid)
    with store.session() as s:
        m = s.get(Machine, mid)
        m.labels = {**m.labels, virtual_media.BOOT_VIA_LABEL: virtual_media.VIRTUAL_MEDIA}
        s.add(m)
        s.commit()
    _provision(store, mid)
    await netboot.reboot_all(store, svc, [mid], actor="test")  # what a claim's release runs
    cd = await _cd(sushy)
    assert cd["Inserted"] is True
    assert cd["Image"].startswith(f"{boot_http[0]}/boot/n/{mid}/")
    assert (await _system_json(sushy))["Boot"]["BootSourceOverrideTarget"] == "Cd"


async def test_unlabelled_machine_still_boots_pxe(api, store: Store, sushy: Sushy) -> None:  # type: ignore[no-untyped-def]
    client, tokens, svc = api
    mid = tokens.machine_a
    await link_redfish(client, tokens, sushy.port, mid)
    _provision(store, mid)
    await netboot.reboot_all(store, svc, [mid], actor="test")
    assert (await _cd(sushy))["Inserted"] is False
    assert (await _system_json(sushy))["Boot"]["BootSourceOverrideTarget"] == "Pxe"


async def test_boot_refusals_say_what_to_do(api, store: Store, sushy: Sushy) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _svc = api
    tech = tokens.header("technician")
    body = {"via": "virtual-media"}
    # No BMC at all.
    _provision(store, tokens.machine_a)
    r = await client.post(f"/api/v1/machines/{tokens.machine_a}/boot", json=body, headers=tech)
    assert r.status == 404 and "register one" in (await r.json())["detail"]
    # An IPMI BMC: no virtual media.
    with store.session() as s:
        s.add(
            Bmc(
                machine_id=tokens.machine_a,
                address="127.0.0.1",
                protocol="ipmi",
                username="u",
                password_enc=b"x",
            )
        )
        s.commit()
    r = await client.post(f"/api/v1/machines/{tokens.machine_a}/boot", json=body, headers=tech)
    assert r.status == 422
    assert r.content_type == "application/problem+json"
    refused = await r.json()
    assert '"via": "network"' in refused["detail"]
    assert refused["capability"] == "virtual-media"  # named, and refused before any fence
    # A machine metald does not boot now (ready, unclaimed).
    await link_redfish(client, tokens, sushy.port)
    r = await client.post(f"/api/v1/machines/{tokens.machine_free}/boot", json=body, headers=tech)
    assert r.status == 409 and "ready" in (await r.json())["detail"]
    assert (await _cd(sushy))["Inserted"] is False
    # Bad input and the wrong role.
    r = await client.post(
        f"/api/v1/machines/{tokens.machine_a}/boot", json={"via": "usb"}, headers=tech
    )
    assert r.status == 422
    r = await client.post(
        f"/api/v1/machines/{tokens.machine_a}/boot",
        json=body,
        headers=tokens.header("orchestrator"),
    )
    assert r.status == 403


async def test_boot_without_a_boot_url_is_refused_naming_the_keys(
    api, cfg: Config, store: Store, sushy: Sushy
) -> None:  # type: ignore[no-untyped-def]
    """With the boot plane off (or on without an address for its URL) nothing serves the ISO:
    the boot is refused at the request (409, the keys to set) before any BMC command, where it
    answered 202 and sent the BMC to http://None:<port>/boot/n/... or nowhere."""
    client, tokens, svc = api
    mid = tokens.machine_a
    await link_redfish(client, tokens, sushy.port, mid)
    _provision(store, mid)
    svc.control.vmedia_base = None  # as the daemon wires it for these configurations
    tech, body = tokens.header("technician"), {"via": "virtual-media"}
    cfg.boot.enabled = False
    r = await client.post(f"/api/v1/machines/{mid}/boot", json=body, headers=tech)
    assert r.status == 409, await r.text()
    detail = (await r.json())["detail"]
    assert "boot.enabled = true" in detail and '"via": "network"' in detail, detail
    cfg.boot.enabled = True
    r = await client.post(f"/api/v1/machines/{mid}/boot", json=body, headers=tech)
    assert r.status == 409 and "boot.server_address" in (await r.json())["detail"]
    assert (await _cd(sushy))["Inserted"] is False
    with store.session() as s:
        assert s.exec(select(Bmc).where(Bmc.machine_id == mid)).one().step_command is None


def test_boot_url_problem_names_what_is_missing(cfg: Config) -> None:
    from ipaddress import IPv4Address

    cfg.boot.enabled = False
    cfg.api.public_url = "https://metald.example"
    assert "boot.enabled" in (virtual_media.boot_url_problem(cfg) or "")  # a URL, no listener
    cfg.boot.enabled = True
    assert virtual_media.boot_url_problem(cfg) is None  # served on api.listen, at public_url
    cfg.boot.http_listen = "10.0.0.1:8081"
    assert "boot.server_address" in (virtual_media.boot_url_problem(cfg) or "")
    cfg.boot.server_address = IPv4Address("10.0.0.1")
    assert virtual_media.boot_url_problem(cfg) is None
    cfg.boot.server_address, cfg.api.public_url = None, ""
    cfg.boot.http_url = "http://10.0.0.1:8081"
    assert virtual_media.boot_url_problem(cfg) is None


def test_a_boot_that_gives_up_after_its_machine_moved_on_still_says_so(
    store: Store, cfg: Config
) -> None:
    """The failure of a boot whose machine is no longer in its operation's state was dropped
    without a trace; it is an event now."""
    tokens = seed(store)
    with store.session() as s:
        netboot._fail(s, tokens.machine_free, "BMC refused the insert", "test", None)
    with store.session() as s:
        ev = s.exec(select(Event).where(Event.kind == netboot.FAILED_EVENT)).one()
        assert (ev.machine_id, ev.reason) == (tokens.machine_free, "BMC refused the insert")


async def test_a_step_cut_off_after_the_insert_resumes_without_a_second_power_off(
    api, store: Store, sushy: Sushy, boot_http
) -> None:  # type: ignore[no-untyped-def]
    """Another instance journaled ``vmedia:insert`` and died: the new run inserts again (insert
    ejects first), sets the CD boot, arms and powers on; it never powers off a second time
    (the machine may already be booting what the first run started)."""
    from metald.bmc import ownership
    from metald.bmc.control import step_key

    client, tokens, svc = api
    mid = tokens.machine_a
    await link_redfish(client, tokens, sushy.port, mid)
    _provision(store, mid)
    with store.session() as s:
        step = step_key(s.get(Machine, mid))
        ownership.mark_step(s, mid, step, command="vmedia:insert", done=False)
        s.commit()
    assert await netboot.boot_from_network(store, svc, mid, actor="test", via="virtual-media")
    cd = await _cd(sushy)
    assert cd["Inserted"] is True
    assert (await _system_json(sushy))["Boot"]["BootSourceOverrideTarget"] == "Cd"
    with store.session() as s:
        actions = [
            e.data["action"] for e in s.exec(select(Event).where(Event.kind == "bmc.power")).all()
        ]
        bmc = s.exec(select(Bmc).where(Bmc.machine_id == mid)).one()
        assert bmc.step_done is True and s.get(Machine, mid).boot_armed
    assert actions == ["on"]


async def _media_boot(client, tokens, store: Store, sushy: Sushy, svc) -> str:  # type: ignore[no-untyped-def]
    mid = tokens.machine_a
    await link_redfish(client, tokens, sushy.port, mid)
    _provision(store, mid)
    assert await netboot.boot_from_network(store, svc, mid, actor="test", via="virtual-media")
    assert (await _cd(sushy))["Inserted"] is True
    return mid


def _events(store: Store, mid: str, kind: str) -> list[Event]:
    with store.session() as s:
        q = select(Event).where(Event.machine_id == mid, Event.kind == kind)
        return list(s.exec(q).all())


async def test_the_iso_is_ejected_once_the_agent_reports(
    api, store: Store, sushy: Sushy, boot_http
) -> None:  # type: ignore[no-untyped-def]
    """Item 2: the boot's agent reports (here: its provisioning failed) and metald ejects the
    ISO through the BMC (sushy really ejects), recorded as an event; a second report finds
    nothing left to eject and sends nothing."""
    client, tokens, svc = api
    from metald.config import EnrollConfig
    from metald.enrollment import enrollment_boot_hooks

    mid = await _media_boot(client, tokens, store, sushy, svc)
    with store.session() as s:  # the claim's image (what provisioning boots)
        m = s.get(Machine, mid)
        m.boot_intent = {"action": "provision", "kernel": "http://x/k", "initrd": "http://x/i"}
        s.add(m)
        s.commit()
    # The ISO's script fetch (its nonce URL) hands the agent its token.
    routes = media_boot.MediaBootRoutes(
        enrollment_boot_hooks(store, "t", EnrollConfig()), "http://x"
    )
    with store.session() as s:
        nonce = media_boot.url_nonce(mid, s.get(Machine, mid).boot_armed)
        script = routes._take(s, mid, nonce, None)
    token = script.split("metald.token=")[1].split()[0]
    r = await client.post(
        "/api/v1/agent/progress",
        json={"phase": "write", "error": "the disk went away"},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status == 200, await r.text()
    await svc.tasks.drain()  # the eject runs in the background
    assert (await _cd(sushy))["Inserted"] is False
    [ejected] = _events(store, mid, virtual_media.EJECTED_EVENT)
    # The event names the ISO with its nonce cut short (never the whole nonce).
    shown = ejected.data["image"]
    assert shown.startswith(f"{boot_http[0]}/boot/n/{mid}/")
    assert len(shown.rsplit("/", 1)[1]) == len("123456....iso")
    assert await virtual_media.eject_after_report(svc.control, mid, "test") is None


async def test_a_pxe_boot_is_never_ejected(api, store: Store, sushy: Sushy) -> None:  # type: ignore[no-untyped-def]
    client, tokens, svc = api
    mid = tokens.machine_a
    await link_redfish(client, tokens, sushy.port, mid)
    _provision(store, mid)
    assert await netboot.boot_from_network(store, svc, mid, actor="test", via="network")
    assert await virtual_media.eject_after_report(svc.control, mid, "test") is None
    assert _events(store, mid, virtual_media.EJECT_FAILED_EVENT) == []


async def test_a_bmc_that_cannot_eject_is_an_event_not_a_stuck_machine(
    api, store: Store, sushy: Sushy
) -> None:  # type: ignore[no-untyped-def]
    client, tokens, svc = api
    mid = await _media_boot(client, tokens, store, sushy, svc)
    with store.session() as s:  # the BMC stops answering (nothing listens on port 9)
        row = s.exec(select(Bmc).where(Bmc.machine_id == mid)).one()
        row.port = 9
        s.add(row)
        s.commit()
    await svc.control.forget(row.id)  # its cached driver goes: the next command uses port 9
    state_before = _state(store, mid)
    assert await virtual_media.eject_after_report(svc.control, mid, "test") is False
    [failed] = _events(store, mid, virtual_media.EJECT_FAILED_EVENT)
    assert "failed" in (failed.reason or "")
    assert _state(store, mid) == state_before
    # Tried once per boot: the next report does not hammer a dead BMC again.
    assert await virtual_media.eject_after_report(svc.control, mid, "test") is None


def _state(store: Store, mid: str) -> str:
    with store.session() as s:
        return s.get(Machine, mid).state  # type: ignore[union-attr]
