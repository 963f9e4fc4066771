"""HTTP boot routes (scripts, assets with Range/ETag/HEAD) and the store-backed hooks."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web
from sqlmodel import select

from metald import machines
from metald.boot.hooks import BootAction, BootTarget, MemoryBootHooks
from metald.boot.http import boot_routes
from metald.boot.ipxe import render_boot_script
from metald.boot.machine_hooks import StoreBootHooks
from metald.lifecycle import State
from metald.store.models import Event

BASE = "http://10.0.0.1:8080"


async def client_for(aiohttp_client, hooks, assets: Path):  # type: ignore[no-untyped-def]
    app = web.Application()
    app.add_routes(boot_routes(hooks, assets, BASE + "/"))
    return await aiohttp_client(app)


def test_render_discovery_local_and_provision() -> None:
    disc = render_boot_script(
        BootTarget(BootAction.DISCOVERY, "d/vmlinuz", "d/initrd"),
        mac="52:54:00:00:00:01",
        public_url=BASE,
    )
    assert disc.startswith("#!ipxe\n")
    assert f"kernel {BASE}/boot/assets/d/vmlinuz initrd=initrd.img metald.url={BASE}" in disc
    assert f"initrd --name initrd.img {BASE}/boot/assets/d/initrd" in disc
    local = render_boot_script(BootTarget(BootAction.LOCAL), mac="m", public_url=BASE)
    assert "exit 0" in local and "kernel" not in local
    prov = render_boot_script(
        BootTarget(BootAction.PROVISION, "http://img/k", None, {"metald.token": "t0k"}),
        mac="m",
        public_url=BASE,
    )
    assert (
        "kernel http://img/k " in prov
        and "metald.token=t0k" in prov
        and "initrd --name" not in prov
    )


async def test_script_for_unknown_and_known_machines(aiohttp_client, store, assets: Path) -> None:  # type: ignore[no-untyped-def]
    minted: list[str] = []

    def mint(session, m, mac, client):  # type: ignore[no-untyped-def]
        minted.append(m.id)
        return "agent-secret"

    hooks = StoreBootHooks(store, "t1", mint_agent_token=mint)
    c = await client_for(aiohttp_client, hooks, assets)
    r = await c.get("/boot/52:54:00:00:00:01.ipxe")
    body = await r.text()
    assert r.status == 200 and "discovery" in body and "discovery/vmlinuz" in body
    assert "metald.token" not in body  # unknown machine: no token to mint for
    # DHCP saw it: it becomes a discovered machine, with option 82 as its rack position.
    await hooks.client_seen(
        "52:54:00:00:00:01",
        arch="bios",
        network="prov",
        relay_agent={"circuit_id": "Eth1/7", "remote_id": "leaf-3"},
    )
    await hooks.client_seen("52:54:00:00:00:01", arch="bios", network="prov", relay_agent=None)

    def check(s):  # type: ignore[no-untyped-def]
        m = machines.find_by_mac(s, "52:54:00:00:00:01")
        evs = s.exec(select(Event).where(Event.machine_id == m.id).order_by(Event.id)).all()
        return m, [e.kind for e in evs]

    m, kinds = await store.run(check)
    assert m.state == State.DISCOVERED.value and m.rack_position == "leaf-3/Eth1/7"
    assert kinds == ["machine.created"]
    # A MAC in hyphen form (iPXE ${mac:hexhyp}) finds the same machine; now a token is minted.
    r = await c.get("/boot/52-54-00-00-00-01.ipxe")
    assert "metald.token=agent-secret" in await r.text() and minted == [m.id]
    # Moved to another switch port: recorded with an event.
    await hooks.client_seen(
        "52:54:00:00:00:01",
        arch="bios",
        network="prov",
        relay_agent={"circuit_id": "Eth1/9", "remote_id": "leaf-3"},
    )
    m, kinds = await store.run(check)
    assert m.rack_position == "leaf-3/Eth1/9" and kinds[-1] == "machine.rack_position"
    assert (await c.get("/boot/not-a-mac.ipxe")).status == 404


async def test_assets_range_etag_head_and_refusals(
    aiohttp_client, assets: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    c = await client_for(aiohttp_client, MemoryBootHooks(), assets)
    data = (assets / "ipxe.efi").read_bytes()
    r = await c.get("/boot/assets/ipxe.efi")
    assert r.status == 200 and await r.read() == data
    etag = r.headers["ETag"]
    r = await c.get("/boot/assets/ipxe.efi", headers={"Range": "bytes=100-199"})
    assert r.status == 206 and await r.read() == data[100:200]
    assert r.headers["Content-Range"] == f"bytes 100-199/{len(data)}"
    r = await c.get("/boot/assets/ipxe.efi", headers={"If-None-Match": etag})
    assert r.status == 304
    r = await c.head("/boot/assets/ipxe.efi")
    assert r.status == 200 and int(r.headers["Content-Length"]) == len(data)
    (tmp_path / "secret").write_text("x")
    (assets / "link").symlink_to(tmp_path / "secret")
    assert (await c.get("/boot/assets/link")).status == 403
    assert (await c.get("/boot/assets/..%2Fsecret")).status in (403, 404)
    assert (await c.get("/boot/assets/nope")).status == 404
