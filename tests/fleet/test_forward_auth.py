"""Forwarding between instances is authenticated (issue 24 item 3): a request marked
``X-Metald-Forwarded-By`` runs where it lands only with a valid ``X-Metald-Forward-Auth``
(HMAC with a key derived from the shared secrets key, at most 30 s old, each nonce once).

One app plays both instances: its BMC service says every BMC is owned at the app's own URL, so
a client's request is forwarded (signed) to itself, where the mark verifies and the handler
runs ("ran here" is the BMC service's 409). A forged, stale, replayed or wrongly keyed mark is
refused (403) on every route that forwards, the console's WebSocket included, and nothing runs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.fernet import Fernet

import api
from api import routes_bmc, routes_console
from api.app import ROUTERS, all_specs
from api.routing import Owner
from metald.errors import Conflict
from metald.fleet import forward_auth
from metald.secrets import SecretBox
from tests.api_helpers import LiveApi, live_api, use_services

MID = "00000000-0000-4000-8000-0000000000aa"

#: A valid body for each forwarding route that takes one (the body is checked before the
#: handler: without it the route would never reach the forwarding decision).
BODIES: dict[str, Any] = {
    "POST /api/v1/bmcs/{id}/power": {"action": "on"},
    "POST /api/v1/machines/{id}/power": {"action": "on"},
    "PUT /api/v1/machines/{id}/boot-device": {"device": "pxe"},
    "PUT /api/v1/machines/{id}/locate": {"on": True},
    "PUT /api/v1/machines/{id}/bios": {"attributes": {"BootMode": "Uefi"}},
    "POST /api/v1/machines/{id}/boot": {"via": "network"},
    "POST /api/v1/machines/{id}/secure-boot": {"enable": True},
}


def _forwarding_routes() -> list[tuple[str, str]]:
    """Every route the router forwards to an owner: those declared with ``owner=`` (found in
    the declarations, so a new forwarding route is tested without being listed here)."""
    out = []
    for spec in all_specs(ROUTERS):
        if spec.owner is not None:
            path = re.sub(r"{(\w+)(?::[^}]*)?}", lambda m: MID if m[1] == "id" else "c1", spec.path)
            out.append((f"{spec.method} {spec.path}", path))
    return out


ROUTES = _forwarding_routes()


def test_every_forwarding_route_is_found() -> None:
    keys = {k for k, _ in ROUTES}
    assert "GET /api/v1/machines/{id}/console" in keys and "POST /api/v1/machines/{id}/boot" in keys
    assert len(keys) >= 16, keys  # 15 BMC commands and the console
    owners = {s.owner for s in routes_bmc.router.specs + routes_console.router.specs}
    assert owners == {None, Owner.BMC, Owner.MACHINE, Owner.CONSOLE}, owners


def _hand_forwarding(path: Path) -> list[str]:
    """Where a module signs or checks a forward (imports ``forward_auth``) or opens a client
    connection of its own (``aiohttp.ClientSession``, ``ws_connect``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (
            node.module == "metald.fleet.forward_auth"
            or any(a.name == "forward_auth" for a in node.names)
        ):
            found.append(f"{node.lineno}: imports forward_auth")
        elif isinstance(node, ast.Attribute) and node.attr in ("ClientSession", "ws_connect"):
            found.append(f"{node.lineno}: {node.attr}")
    return found


def test_no_route_module_forwards_by_hand() -> None:
    """Forwarding is the router's (``api.routing.Owner``, over ``api.forwarding``): no other
    API module signs a forward, checks a mark or opens a client connection of its own."""
    api_dir = Path(api.__file__).parent
    hand = {
        str(p.relative_to(api_dir)): found
        for p in sorted(api_dir.rglob("*.py"))
        if p.name not in ("routing.py", "forwarding.py") and (found := _hand_forwarding(p))
    }
    assert not hand, hand
    assert _hand_forwarding(api_dir / "routing.py") and _hand_forwarding(api_dir / "forwarding.py")


class _Here:
    """The BMC and console services: every BMC is owned at ``url``; anything run here is
    recorded and answered 409 "ran here"."""

    def __init__(self) -> None:
        self.url: str | None = None
        self.ran: list[str] = []

    async def owner_url(self, **_kw: Any) -> str | None:
        return self.url

    def __getattr__(self, name: str) -> Any:
        def run(*_a: Any, **_kw: Any) -> Any:  # raises before an await would matter
            self.ran.append(name)
            raise Conflict("ran here")

        return run


@pytest.fixture
async def live(aiohttp_client, store, tmp_path: Path) -> LiveApi:  # type: ignore[no-untyped-def]
    live = await live_api(aiohttp_client, store, tmp_path)
    here = _Here()
    here.url = f"http://127.0.0.1:{live.port}"
    use_services(live.ctx, bmc=here, console=here)
    return live


async def _call(live: LiveApi, key: str, path: str, headers: dict[str, str]) -> tuple[int, str]:
    method = key.split()[0]
    headers = {"Authorization": f"Bearer {live.tokens.admin}", **headers}
    if key.endswith("/console"):
        try:
            ws = await live.client.ws_connect(path, headers=headers)
        except aiohttp.WSServerHandshakeError as e:
            return e.status, ""
        await ws.close()
        return 101, ""
    r = await live.client.request(method, path, json=BODIES.get(key), headers=headers)
    return r.status, (await r.json()).get("detail", "")


@pytest.mark.parametrize("key,path", ROUTES, ids=[k for k, _ in ROUTES])
async def test_a_forged_stale_or_replayed_forward_mark_is_refused(
    live: LiveApi, key: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = live.ctx.services.bmc
    assert isinstance(here, _Here)
    box = live.ctx.secrets
    method = key.split()[0]

    # A client claiming to be an instance that forwards (the mark unsigned): refused, not run.
    status, _ = await _call(live, key, path, {forward_auth.FORWARDED: "rack1"})
    assert status == 403 and here.ran == [], status

    # A client's request is forwarded to the owner (here itself), signed; the owner runs it
    # (the BMC service's 409 "ran here", or the boot route's own 404 for an unknown machine).
    status, detail = await _call(live, key, path, {})
    assert status in (404, 409) and len(live.requests) == 3, (status, detail)
    forwarded = [r for r in live.requests if r.headers.get(forward_auth.FORWARDED)]
    assert len(forwarded) == 2 and forwarded[1].headers.get(forward_auth.AUTH)
    captured = {h: forwarded[1].headers[h] for h in (forward_auth.FORWARDED, forward_auth.AUTH)}
    here.ran.clear()

    other = SecretBox(Fernet.generate_key())
    monkeypatch.setattr(forward_auth.time, "time", lambda t=forward_auth.time.time(): t - 60)
    stale = forward_auth.sign(box, method, path, "rack1")
    monkeypatch.undo()
    marks = {
        "forged (no signature)": {forward_auth.FORWARDED: "rack1"},
        "replayed": captured,
        "stale": stale,
        "another key": forward_auth.sign(other, method, path, "rack1"),
        "another path": forward_auth.sign(box, method, path + "x", "rack1"),
        "another instance": {
            **forward_auth.sign(box, method, path, "rack1"),
            forward_auth.FORWARDED: "rack2",
        },
        "garbled": {forward_auth.FORWARDED: "rack1", forward_auth.AUTH: "t=1,s=00"},
    }
    for what, headers in marks.items():
        status, _ = await _call(live, key, path, headers)
        assert status == 403, (what, status)
    assert here.ran == []

    # A valid mark from another instance: run here, not forwarded again.
    before = len(live.requests)
    status, _ = await _call(live, key, path, forward_auth.sign(box, method, path, "rack1"))
    assert status in (404, 409) and len(live.requests) == before + 1


class _Answering(_Here):
    """An owner that answers: a power action still pending (202), the locate light, and a
    refusal carrying a field of its own."""

    async def power(self, machine_id: str, action: str, **_kw: Any) -> dict[str, Any]:
        return {
            "machine_id": machine_id,
            "bmc_id": "b1",
            "action": action,
            "power_state": None,
            "command_id": "c1",
            "status": "pending",
            "target_state": "on",
        }

    async def locate(self, machine_id: str, on: bool | None, **_kw: Any) -> dict[str, Any]:
        return {"machine_id": machine_id, "bmc_id": "b1", "on": on}

    async def sensors(self, machine_id: str) -> list[dict[str, Any]]:
        raise Conflict("the BMC is busy", state="busy")


async def test_the_owners_answer_comes_back_as_it_is(
    aiohttp_client,  # type: ignore[no-untyped-def]
    store,
    tmp_path: Path,
) -> None:
    """Whatever the owner answers is the answer: its status (202 for a command still pending
    there, not the route's declared 200), its body, and a refusal as the same problem with
    its own fields."""
    live = await live_api(aiohttp_client, store, tmp_path)
    owner = _Answering()
    owner.url = f"http://127.0.0.1:{live.port}"
    use_services(live.ctx, bmc=owner, console=owner)
    auth = {"Authorization": f"Bearer {live.tokens.admin}"}
    base = f"/api/v1/machines/{MID}"

    r = await live.client.post(f"{base}/power", json={"action": "on"}, headers=auth)
    assert r.status == 202, await r.text()
    assert (await r.json())["command_id"] == "c1"
    r = await live.client.put(f"{base}/locate", json={"on": True}, headers=auth)
    assert r.status == 200 and await r.json() == {"machine_id": MID, "bmc_id": "b1", "on": True}
    r = await live.client.get(f"{base}/sensors", headers=auth)
    body = await r.json()
    assert r.status == 409 and body["detail"] == "the BMC is busy" and body["state"] == "busy"
    # Each went to the owner (here itself) once, signed, and ran there.
    forwarded = [q for q in live.requests if q.headers.get(forward_auth.FORWARDED)]
    assert len(live.requests) == 6 and len(forwarded) == 3
    assert all(q.headers.get(forward_auth.AUTH) for q in forwarded)
