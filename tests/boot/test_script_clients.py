"""[boot] script_clients = "leased": a script that carries an agent token goes only to the
address metald's DHCP bound to that MAC. Anyone else gets 403, no token, and the machine's
current token stays valid."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web

from metald import auth, machines
from metald.boot.hooks import ScriptRefused
from metald.boot.http import boot_routes
from metald.config import EnrollConfig, load_config
from metald.enrollment import enrollment_boot_hooks
from tests.dhcp_leases import add_lease

MAC = "52:54:00:aa:00:01"


async def _client(aiohttp_client, hooks, assets: Path):  # type: ignore[no-untyped-def]
    app = web.Application()
    app.add_routes(boot_routes(hooks, assets, "http://10.0.0.1:8080/"))
    return await aiohttp_client(app)


async def test_only_the_lease_holder_gets_a_token(aiohttp_client, store, assets: Path) -> None:  # type: ignore[no-untyped-def]
    hooks = enrollment_boot_hooks(store, "t", EnrollConfig(), leased_clients_only=True)
    await hooks.client_seen(MAC, arch="bios", network="prov", relay_agent=None)
    c = await _client(aiohttp_client, hooks, assets)

    # No lease at all: refused, and nothing minted.
    r = await c.get(f"/boot/{MAC}.ipxe")
    assert r.status == 403 and "does not hold the lease" in await r.text()
    with store.session() as s:
        m = machines.find_by_mac(s, MAC)
        assert m is not None and m.state == "discovered"  # not moved to inspecting either

    # The MAC's lease is on another address (the test client asks from 127.0.0.1).
    add_lease(store, MAC, "10.0.0.50")
    assert (await c.get(f"/boot/{MAC}.ipxe")).status == 403
    # Another MAC's lease on the asking address does not help.
    add_lease(store, "52:54:00:aa:00:99", "127.0.0.1")
    assert (await c.get(f"/boot/{MAC}.ipxe")).status == 403

    # The lease holder gets the script with a token; a refused request afterwards does not
    # revoke it.
    add_lease(store, MAC, "127.0.0.1", network="prov2")  # the asker's own, another network
    r = await c.get(f"/boot/{MAC}.ipxe")
    body = await r.text()
    assert r.status == 200 and "metald.token=" in body
    token = body.split("metald.token=")[1].split()[0]
    with pytest.raises(ScriptRefused):
        await hooks.boot_target(MAC, client="10.0.0.99")
    with store.session() as s:
        assert auth.authenticate(s, token) is not None


async def test_expired_or_unbound_leases_do_not_count(store) -> None:  # type: ignore[no-untyped-def]
    hooks = enrollment_boot_hooks(store, "t", EnrollConfig(), leased_clients_only=True)
    await hooks.client_seen(MAC, arch="bios", network="prov", relay_agent=None)
    add_lease(store, MAC, "10.0.0.7", ttl_s=-10)
    add_lease(store, MAC, "10.0.0.8", state="offered")
    for ip in ("10.0.0.7", "10.0.0.8", None):
        with pytest.raises(ScriptRefused):
            await hooks.boot_target(MAC, client=ip)
    add_lease(store, MAC, "10.0.0.9")
    t = await hooks.boot_target(MAC, client="10.0.0.9")
    assert "metald.token" in t.kernel_args


async def test_local_boots_carry_no_token_and_need_no_lease(store) -> None:  # type: ignore[no-untyped-def]
    hooks = enrollment_boot_hooks(store, "t", EnrollConfig(), leased_clients_only=True)
    await hooks.client_seen(MAC, arch="bios", network="prov", relay_agent=None)
    with store.session() as s:
        m = machines.find_by_mac(s, MAC)
        assert m is not None
        machines.transition(s, m.id, "maintenance-on", actor="test")
    t = await hooks.boot_target(MAC, client="10.9.9.9")
    assert t.action.value == "local" and "metald.token" not in t.kernel_args


def test_config_default_follows_dhcp_mode() -> None:
    assert load_config(None, environ={}).boot.scripts_leased_only
    proxy = load_config(None, environ={"METALD_BOOT__DHCP_MODE": "proxy"})
    assert not proxy.boot.scripts_leased_only
    anyone = load_config(None, environ={"METALD_BOOT__SCRIPT_CLIENTS": "any"})
    assert not anyone.boot.scripts_leased_only


async def test_a_boot_hands_out_one_token(store) -> None:  # type: ignore[no-untyped-def]
    """The first script of a boot metald started carries the token; asking again in the same
    boot (the lease holder itself, or a tenant's OS that kept running) gets the script without
    one, one ``boot.script_refetched`` event per boot, and the first token stays valid."""
    from sqlmodel import select

    from metald.store.models import Event

    hooks = enrollment_boot_hooks(store, "t", EnrollConfig(), leased_clients_only=True)
    await hooks.client_seen(MAC, arch="bios", network="prov", relay_agent=None)
    add_lease(store, MAC, "10.0.0.9")
    first = await hooks.boot_target(MAC, client="10.0.0.9")
    token = first.kernel_args["metald.token"]
    for _ in range(3):
        again = await hooks.boot_target(MAC, client="10.0.0.9")
        assert again.action.value == "discovery" and "metald.token" not in again.kernel_args
    with store.session() as s:
        assert auth.authenticate(s, token) is not None
        events = s.exec(select(Event).where(Event.kind == "boot.script_refetched")).all()
        assert len(events) == 1 and events[0].data["client"] == "10.0.0.9"  # type: ignore[index]
