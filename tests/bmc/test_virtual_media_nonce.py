"""Per-boot nonce URLs of virtual-media boots (issue 16 item 3, "someone else's DHCP"): the
ISO a BMC fetches and the one script carrying the boot's agent token are reached by the boot's
nonce, not by holding metald's lease. Attacker's view: a tenant on the network who guesses,
alters or replays a nonce, or asks for the MAC's script, gets no token; nonces are never
logged in full."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from aiohttp import web

from bootassets.iso import SCRIPT_NAME
from metald import machines
from metald.boot.http import boot_routes
from metald.config import EnrollConfig
from metald.enrollment import enrollment_boot_hooks
from metald.lifecycle import Trigger
from metald.provision import boots, media_boot
from metald.store.models import Machine

MAC = "52:54:00:aa:00:07"
BASE = "http://10.0.0.1:8080"
IPXE_ISO = Path("/usr/lib/ipxe/ipxe.iso")


@pytest.fixture
def assets(tmp_path: Path) -> Path:
    (tmp_path / "assets").mkdir()
    return tmp_path / "assets"


async def _setup(aiohttp_client, store, assets: Path, *, leased: bool = True):  # type: ignore[no-untyped-def]
    hooks = enrollment_boot_hooks(store, "t", EnrollConfig(), leased_clients_only=leased)
    with store.session() as s:
        m = machines.create_machine(s, macs=[MAC], actor="test")
        machines.transition(s, m.id, Trigger.INSPECT, actor="test")
        mid = m.id
    app = web.Application()
    app.add_routes(boot_routes(hooks, assets, BASE))
    app.add_routes(media_boot.MediaBootRoutes(hooks, BASE).routes())
    return await aiohttp_client(app), mid


def _arm_media(store, mid: str) -> str:  # type: ignore[no-untyped-def]
    """What the driver does before inserting: arm a media boot; returns the URL nonce."""
    with store.session() as s:
        armed = boots.arm_boot(s, mid, media=True)
        s.commit()
    return media_boot.url_nonce(mid, armed)


async def test_the_nonce_script_carries_the_token_once_without_a_lease(
    aiohttp_client, store, assets: Path, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.DEBUG)
    c, mid = await _setup(aiohttp_client, store, assets, leased=True)
    nonce = _arm_media(store, mid)
    # Asking by MAC: refused in "leased" mode (no lease: someone else's DHCP), and no token.
    r = await c.get(f"/boot/{MAC}.ipxe")
    assert r.status == 403
    # Wrong nonces: a random one, the right one altered, upper-cased, cut, another machine's.
    with store.session() as s:
        other = machines.create_machine(s, macs=["52:54:00:aa:00:08"], actor="test")
        machines.transition(s, other.id, Trigger.INSPECT, actor="test")
        other_id = other.id
    other_nonce = _arm_media(store, other_id)
    flipped = nonce[:-1] + ("0" if nonce[-1] != "0" else "1")
    for bad in (
        f"{mid}/{'0' * 32}",
        f"{mid}/{flipped}",
        f"{mid}/{nonce.upper()}",
        f"{mid}/{nonce[:31]}",
        f"{mid}/{other_nonce}",
        f"{other_id}/{nonce}",
    ):
        for kind in ("ipxe", "iso"):
            r = await c.get(f"/boot/n/{bad}.{kind}")
            assert r.status == 404, (bad, kind)
    # The right nonce, from an address that holds no lease: the script with the token.
    r = await c.get(f"/boot/n/{mid}/{nonce}.ipxe")
    body = await r.text()
    assert r.status == 200 and "metald.token=" in body, body
    # Replayed: nothing, and the ISO URL died with the boot.
    assert (await c.get(f"/boot/n/{mid}/{nonce}.ipxe")).status == 404
    assert (await c.get(f"/boot/n/{mid}/{nonce}.iso")).status == 404
    # The nonce was never logged in full (only its first 6 digits).
    # (metald's own loggers: the daemon serves HTTP without aiohttp's access log)
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("metald"))
    assert nonce not in logged and other_nonce not in logged
    assert f"{nonce[:6]}..." in logged


async def test_the_per_mac_script_never_takes_a_media_boot(
    aiohttp_client, store, assets: Path
) -> None:  # type: ignore[no-untyped-def]
    """In "any" mode (proxy DHCP, or none of ours) whoever asks for the MAC gets its script:
    a tenant doing so during a virtual-media boot gets it without a token, and the boot's own
    nonce still works afterwards."""
    c, mid = await _setup(aiohttp_client, store, assets, leased=False)
    nonce = _arm_media(store, mid)
    r = await c.get(f"/boot/{MAC}.ipxe")
    assert r.status == 200 and "metald.token=" not in await r.text()
    r = await c.get(f"/boot/n/{mid}/{nonce}.ipxe")
    assert r.status == 200 and "metald.token=" in await r.text()


async def test_a_nonce_expires_with_its_boot(aiohttp_client, store, assets: Path) -> None:  # type: ignore[no-untyped-def]
    c, mid = await _setup(aiohttp_client, store, assets)
    old = _arm_media(store, mid)
    new = _arm_media(store, mid)  # re-armed (a retried boot): the old nonce is dead
    assert (await c.get(f"/boot/n/{mid}/{old}.ipxe")).status == 404
    with store.session() as s:  # the machine leaves the states metald boots
        machines.transition(s, mid, Trigger.INSPECT_FAIL, actor="test")
    assert (await c.get(f"/boot/n/{mid}/{new}.ipxe")).status == 404
    with store.session() as s:
        assert s.get(Machine, mid).boot_armed  # refused before anything was taken


@pytest.mark.skipif(not IPXE_ISO.exists(), reason="needs Debian's ipxe package")
async def test_the_per_boot_iso_chains_to_its_nonce_script(
    aiohttp_client, store, assets: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    from bootassets.iso import read_file

    c, mid = await _setup(aiohttp_client, store, assets)
    nonce = _arm_media(store, mid)
    r = await c.get(f"/boot/n/{mid}/{nonce}.iso")
    assert r.status == 200
    iso = tmp_path / "boot.iso"
    iso.write_bytes(await r.read())
    script = read_file(iso, SCRIPT_NAME.lower()).decode()
    assert re.search(rf"chain --autofree {BASE}/boot/n/{mid}/{nonce}\.ipxe", script), script
    # A BMC may fetch it again, or by ranges, while the boot is armed.
    r = await c.get(f"/boot/n/{mid}/{nonce}.iso", headers={"Range": "bytes=0-15"})
    assert r.status == 206 and len(await r.read()) == 16
    with store.session() as s:
        assert media_boot.is_media_boot(s.get(Machine, mid).boot_armed)  # nothing taken


async def test_require_https_keeps_the_nonce_script_off_plain_http(
    aiohttp_client, store, assets: Path
) -> None:  # type: ignore[no-untyped-def]
    """[boot] require_https: the nonce script carries an agent token, so plain HTTP gets a 403
    problem+json, and the nonce is not spent by the refusal. Served, it carries the pin."""
    from metald.boot import pki

    ca = pki.ensure_boot_tls(assets.parent / "state", "10.0.0.1").ca_pem
    hooks = enrollment_boot_hooks(store, "t", EnrollConfig(), leased_clients_only=False)
    with store.session() as s:
        m = machines.create_machine(s, macs=[MAC], actor="test")
        machines.transition(s, m.id, Trigger.INSPECT, actor="test")
        mid = m.id
    nonce = _arm_media(store, mid)
    strict = web.Application()
    strict.add_routes(media_boot.MediaBootRoutes(hooks, BASE, require_https=True).routes())
    c = await aiohttp_client(strict)
    r = await c.get(f"/boot/n/{mid}/{nonce}.ipxe")
    assert r.status == 403 and r.content_type == "application/problem+json"
    assert "metald.token" not in await r.text()
    # the same nonce still works where the script is allowed (here: the pin rides along)
    lax = web.Application()
    lax.add_routes(media_boot.MediaBootRoutes(hooks, BASE, ca_pem=ca).routes())
    c2 = await aiohttp_client(lax)
    r = await c2.get(f"/boot/n/{mid}/{nonce}.ipxe")
    body = await r.text()
    assert r.status == 200 and "metald.token=" in body
    assert f"metald.ca={pki.ca_fingerprint(ca)}" in body
