"""The tenant mesh through HTTP on both backends: node tokens, views, isolation, long-poll,
acknowledgements, and the release that waits for them before the wipe's power cycle."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlmodel import col, select

from api.app import CTX_KEY
from metald import machines
from metald.lifecycle import Trigger
from metald.store.models import Event, WgPeer
from metald.tenants import clusters, keys, mesh
from tests.api_helpers import drain_steps, use_services
from tests.claims.fakes import FakeBmc
from tests.claims.helpers import add_ready


def _pub() -> str:
    return keys.public_key(keys.generate_private_key())


async def _join(client: Any, headers: dict[str, str], machine_id: str, store: Any) -> dict:
    """Provisioned -> join token -> join; returns the join answer."""
    with store.session() as s:
        m = machines.get_machine(s, machine_id)
        if m.state == "claimed":
            machines.transition(s, m.id, Trigger.PROVISION, actor="test")
        if machines.get_machine(s, m.id).state == "provisioning":
            machines.transition(s, m.id, Trigger.PROVISIONED, actor="test")
    r = await client.post(f"/api/v1/machines/{machine_id}/join-token", json={}, headers=headers)
    assert r.status == 201, await r.text()
    token = (await r.json())["token"]
    r = await client.post("/api/v1/join", json={"token": token, "public_key": _pub()})
    assert r.status == 200, await r.text()
    return await r.json()


async def _mesh(client: Any, node_token: str, applied: int = 0, wait_s: float = 0) -> Any:
    return await client.post(
        "/api/v1/mesh",
        json={"applied": applied, "wait_s": wait_s},
        headers={"Authorization": f"Bearer {node_token}"},
    )


async def _hubs(client: Any, tokens: Any) -> None:
    admin = tokens.header("admin")
    for tid, host in ((tokens.tenant_a, "10.99.0.1"), (tokens.tenant_b, "10.99.1.1")):
        r = await client.post(
            f"/api/v1/tenants/{tid}/hub", json={"endpoint_host": host}, headers=admin
        )
        assert r.status == 201, await r.text()


async def _claim(client: Any, tokens: Any, store: Any, n: int) -> tuple[str, list[str]]:
    r = await client.post(
        "/api/v1/images",
        json={
            "name": "node",
            "kind": "stateless",
            "kernel": "node/vmlinuz",
            "initrd": "node/initrd.img",
        },
        headers=tokens.header("technician"),
    )
    assert r.status == 201, await r.text()
    add_ready(store, n, labels={"pool": "mesh"})
    r = await client.post(
        "/api/v1/claims",
        json={
            "tenant_id": tokens.tenant_a,
            "count": n,
            "selector": {"labels": {"pool": "mesh"}},
            "image_id": (await r.json())["id"],
        },
        headers=tokens.header("orchestrator"),
    )
    assert r.status == 201, await r.text()
    claim = await r.json()
    await drain_steps(client)
    return claim["id"], [m["id"] for m in claim["machines"]]


async def test_views_hold_the_tenants_other_nodes_only(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    await _hubs(client, tokens)
    orch, other = tokens.header("orchestrator"), tokens.header("orchestrator_other")
    a1 = await _join(client, orch, tokens.machine_a, store)
    b1 = await _join(client, other, tokens.machine_b, store)
    # A second node of tenant A: the third seeded machine, claimed for A.
    with store.session() as s:
        machines.transition(
            s,
            tokens.machine_free,
            Trigger.CLAIM,
            actor="test",
            updates={"tenant_id": tokens.tenant_a},
        )
    a2 = await _join(client, orch, tokens.machine_free, store)
    for j in (a1, a2, b1):
        assert j["mesh"]["node_token"].startswith("mnt_") and j["mesh"]["path"] == "/api/v1/mesh"

    views = {}
    for name, j in (("a1", a1), ("a2", a2), ("b1", b1)):
        r = await _mesh(client, j["mesh"]["node_token"])
        assert r.status == 200, await r.text()
        views[name] = await r.json()
    addr = {n: j["overlay_address"].split("/")[0] for n, j in (("a1", a1), ("a2", a2), ("b1", b1))}
    assert [p["address"] for p in views["a1"]["peers"]] == [addr["a2"]]
    assert [p["address"] for p in views["a2"]["peers"]] == [addr["a1"]]
    assert views["b1"]["peers"] == []  # B's only node: nothing of A's
    peer = views["a1"]["peers"][0]
    assert peer["allowed_ips"] == [f"{addr['a2']}/32"]
    # Its endpoint: the address its join came from, at the nodes' listen port.
    assert peer["endpoint"] == f"127.0.0.1:{mesh.NODE_LISTEN_PORT}"
    assert views["a1"]["hub"]["allowed_ips"] == [a1["allowed_ips"][0]]  # last resort: the /24
    assert views["a1"]["guard"] == {
        "wireguard_port": mesh.NODE_LISTEN_PORT,
        "sources": ["10.99.0.1", "127.0.0.1"],
    }
    assert views["b1"]["guard"]["sources"] == ["10.99.1.1"]
    text = str(views["a1"]) + str(views["a2"])
    with store.session() as s:
        b_peer = s.exec(select(WgPeer).where(WgPeer.tenant_id == tokens.tenant_b)).one()
    assert b_peer.public_key not in text and addr["b1"] not in text


async def test_node_token_opens_the_mesh_view_only(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    await _hubs(client, tokens)
    j = await _join(client, tokens.header("orchestrator"), tokens.machine_a, store)
    node = j["mesh"]["node_token"]
    r = await client.get(
        f"/api/v1/machines/{tokens.machine_a}", headers={"Authorization": f"Bearer {node}"}
    )
    assert r.status == 401
    r = await _mesh(client, tokens.admin)  # an API token is not a node token
    assert r.status == 401 and "mnt_" in (await r.json())["detail"]
    r = await client.post("/api/v1/mesh", json={"applied": 0})
    assert r.status == 401
    r = await _mesh(client, "mnt_" + "x" * 43)
    assert r.status == 401 and "revoked" in (await r.json())["detail"]
    r = await _mesh(client, node, applied=-1)
    assert r.status == 422
    # Revoking the peer revokes the token with it.
    r = await client.delete(
        f"/api/v1/machines/{tokens.machine_a}/peer", headers=tokens.header("orchestrator")
    )
    assert r.status == 200
    r = await _mesh(client, node)
    assert r.status == 401


async def test_long_poll_wakes_on_a_join_and_acks_are_capped(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    await _hubs(client, tokens)
    orch = tokens.header("orchestrator")
    a1 = await _join(client, orch, tokens.machine_a, store)
    tok = a1["mesh"]["node_token"]
    first = await (await _mesh(client, tok, applied=10_000)).json()
    with store.session() as s:  # a node cannot acknowledge a generation it was never given
        assert (
            s.exec(select(WgPeer.mesh_acked).where(WgPeer.machine_id == tokens.machine_a)).one()
            == first["generation"]
        )
    waiting = asyncio.create_task(_mesh(client, tok, applied=first["generation"], wait_s=30))
    await asyncio.sleep(0)  # let the poll reach its wait (correctness does not depend on it)
    with store.session() as s:
        machines.transition(
            s,
            tokens.machine_free,
            Trigger.CLAIM,
            actor="test",
            updates={"tenant_id": tokens.tenant_a},
        )
    a2 = await _join(client, orch, tokens.machine_free, store)
    got = await (await asyncio.wait_for(waiting, 25)).json()
    assert got["generation"] > first["generation"]
    assert [p["public_key"] for p in got["peers"]] == [_peer_key(store, tokens.machine_free)]
    assert a2["mesh"]["node_token"] != tok


def _peer_key(store: Any, machine_id: str) -> str:
    with store.session() as s:
        return s.exec(select(WgPeer.public_key).where(WgPeer.machine_id == machine_id)).one()


class WatchingBmc(FakeBmc):
    """Records, at each BMC call, what every still-running node has applied."""

    def __init__(self, applied: dict[str, dict]) -> None:
        super().__init__(power_state="on")
        self.applied = applied
        self.seen_at_call: list[tuple[str, dict[str, set[str]]]] = []

    def _snapshot(self, machine_id: str) -> None:
        snapshot = {n: {p["address"] for p in v["peers"]} for n, v in self.applied.items()}
        self.seen_at_call.append((machine_id, snapshot))

    async def set_boot_device(self, machine_id: str, *args: Any, **kw: Any) -> None:
        self._snapshot(machine_id)
        await super().set_boot_device(machine_id, *args, **kw)

    async def power(self, machine_id: str, *args: Any, **kw: Any) -> Any:
        self._snapshot(machine_id)
        return await super().power(machine_id, *args, **kw)

    async def read_power(self, machine_id: str, *args: Any, **kw: Any) -> Any:
        self._snapshot(machine_id)
        return await super().read_power(machine_id, *args, **kw)


async def _node_loop(client: Any, name: str, token: str, applied: dict[str, dict]) -> None:
    """A node agent: long-poll, apply (here: remember), acknowledge with the next poll."""
    gen = 0
    while True:
        r = await _mesh(client, token, applied=gen, wait_s=30)
        if r.status == 401:
            return
        v = await r.json()
        applied[name] = v
        gen = v["generation"]


@pytest.mark.parametrize("acking", [True, False])
async def test_release_waits_for_the_mesh_before_the_wipe(api, monkeypatch, acking: bool) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    monkeypatch.setattr(mesh, "RELEASE_ACK_TIMEOUT_S", 1.0)
    await _hubs(client, tokens)
    applied: dict[str, dict] = {}
    bmc = WatchingBmc(applied)
    use_services(client.server.app[CTX_KEY], bmc=bmc)
    claim_id, ids = await _claim(client, tokens, store, 3)
    orch = tokens.header("orchestrator")
    joins = {mid: await _join(client, orch, mid, store) for mid in ids}
    gone = ids[2]
    gone_addr = joins[gone]["overlay_address"].split("/")[0]
    loops = []
    for mid in ids[:2]:
        tok = joins[mid]["mesh"]["node_token"]
        if acking:
            loops.append(asyncio.create_task(_node_loop(client, mid, tok, applied)))
        else:  # a node that fetched its view once, then hangs: the release must not wait forever
            applied[mid] = await (await _mesh(client, tok)).json()
    while acking and not all(
        gone_addr in {p["address"] for p in applied.get(m, {"peers": []})["peers"]} for m in ids[:2]
    ):
        await asyncio.sleep(0.01)
    bmc.calls.clear()
    r = await client.post(f"/api/v1/claims/{claim_id}/machines/{gone}/release", headers=orch)
    assert r.status == 200, await r.text()
    await drain_steps(client)
    # The wipe's boot went through the BMC (power off confirmed, then one-time PXE).
    assert (gone, "boot", "pxe") in bmc.calls
    with store.session() as s:
        ev = s.exec(
            select(Event).where(Event.kind == "tenant.mesh.released").order_by(col(Event.id))
        ).one()
    assert ev.data["machines"] == [gone]
    if acking:
        # At the wipe's first BMC command, no remaining node still had the released one.
        (mid, snapshot), *_ = [c for c in bmc.seen_at_call if c[0] == gone]
        assert all(gone_addr not in addrs for addrs in snapshot.values()), snapshot
        assert ev.data["acknowledged"] is True and ev.data["pending"] == [], ev.data
    else:
        assert ev.data["acknowledged"] is False and sorted(ev.data["pending"]) == sorted(ids[:2])
    for t in loops:
        t.cancel()


async def test_tenant_machines_may_reach_their_mesh_view(api) -> None:  # type: ignore[no-untyped-def]
    """The API's guard against tenant machines lets the mesh call through (and nothing new)."""
    from metald.nodeguard import TenantNodeGuard

    client, tokens, store = api
    await _hubs(client, tokens)
    j = await _join(client, tokens.header("orchestrator"), tokens.machine_a, store)
    g = TenantNodeGuard(store)
    g.addresses = frozenset({"127.0.0.1"})  # this test client is a tenant's machine
    use_services(client.server.app[CTX_KEY], tenant_node_guard=g)
    r = await _mesh(client, j["mesh"]["node_token"])
    assert r.status == 200, await r.text()
    r = await client.get("/api/v1/mesh", headers={"Authorization": f"Bearer {tokens.admin}"})
    assert r.status in (403, 405)
    r = await client.get(f"/api/v1/tenants/{tokens.tenant_a}/hub", headers=tokens.header("admin"))
    assert r.status == 403


def test_where_the_hub_sees_a_node_becomes_its_mesh_endpoint(env) -> None:  # type: ignore[no-untyped-def]
    """The join's source address is a node's first endpoint; once the hub sees its WireGuard
    somewhere else, that is where the others dial it (a new generation)."""
    from metald.tenants import runtime
    from netconfig.uapi import PeerStatus
    from tests.tenants.conftest import Env

    e: Env = env
    with e.store.session() as s:
        secret, _ = clusters.issue_join_token(s, e.tokens.machine_a, actor="test")
    pub = _pub()
    with e.store.session() as s:
        result = clusters.join(s, e.box, secret, pub, registered_from="10.1.0.20")
    me_token = result.node_token
    with e.store.session() as s:
        peer = s.exec(select(WgPeer).where(WgPeer.machine_id == e.tokens.machine_a)).one()
        assert mesh.endpoint_of(peer) == f"10.1.0.20:{mesh.NODE_LISTEN_PORT}"
        gen = mesh.generation(s, e.tokens.tenant_a)
    with e.store.session() as s:
        runtime.observe_tenant(
            s, e.tokens.tenant_a, {pub: PeerStatus(pub, endpoint="10.1.0.99:51820")}, None, "i1"
        )
    with e.store.session() as s:
        assert mesh.generation(s, e.tokens.tenant_a) == gen + 1
        peer = s.exec(select(WgPeer).where(WgPeer.machine_id == e.tokens.machine_a)).one()
        assert mesh.endpoint_of(peer) == "10.1.0.99:51820"
        # Its own view never lists itself; the guard admits the hub.
        v = mesh.view_for_token(s, me_token)
        assert v.peers == [] and v.sources == ["10.99.0.1"]


async def test_held_long_polls_are_capped_per_token_and_per_instance(api) -> None:  # type: ignore[no-untyped-def]
    """A node token may hold ``api.mesh_polls_per_token`` waiting polls and the instance
    ``api.mesh_polls_max``; beyond either, a 429 with Retry-After at once (not a held socket).
    A poll that does not wait is never refused; the held ones still wake on a change."""
    client, tokens, store = api
    ctx = client.server.app[CTX_KEY]
    cfg = ctx.cfg.model_copy(deep=True)
    cfg.api.mesh_polls_per_token, cfg.api.mesh_polls_max = 2, 3
    ctx.mesh_polls = type(ctx)(cfg, ctx.store, ctx.secrets, ctx.bus).mesh_polls  # as configured
    await _hubs(client, tokens)
    orch = tokens.header("orchestrator")
    a1 = await _join(client, orch, tokens.machine_a, store)
    with store.session() as s:
        machines.transition(
            s,
            tokens.machine_free,
            Trigger.CLAIM,
            actor="test",
            updates={"tenant_id": tokens.tenant_a},
        )
    a2 = await _join(client, orch, tokens.machine_free, store)
    t1, t2 = a1["mesh"]["node_token"], a2["mesh"]["node_token"]
    gen = (await (await _mesh(client, t1)).json())["generation"]

    async def holding(n: int) -> None:
        async with asyncio.timeout(10):
            while ctx.mesh_polls.held() < n:
                await asyncio.sleep(0.01)

    held = [asyncio.create_task(_mesh(client, t1, applied=gen, wait_s=30)) for _ in range(2)]
    await holding(2)
    r = await asyncio.wait_for(_mesh(client, t1, applied=gen, wait_s=30), 5)
    assert r.status == 429, await r.text()
    assert r.headers["Retry-After"].isdigit()
    assert "a token may hold at most 2 mesh long-polls" in (await r.json())["detail"]
    held.append(asyncio.create_task(_mesh(client, t2, applied=gen, wait_s=30)))
    await holding(3)
    r = await asyncio.wait_for(_mesh(client, t2, applied=gen, wait_s=30), 5)
    assert r.status == 429, await r.text()
    assert "at most 3 mesh long-polls" in (await r.json())["detail"]
    r = await _mesh(client, t2, applied=gen)  # no wait: answered at once, whatever is held
    assert r.status == 200, await r.text()
    # A change wakes every held poll; their places are given back.
    r = await client.delete(f"/api/v1/machines/{tokens.machine_free}/peer", headers=orch)
    assert r.status == 200, await r.text()
    answers = await asyncio.wait_for(asyncio.gather(*held), 25)
    assert [a.status for a in answers] == [200, 200, 401]  # t2's peer was the one revoked
    assert ctx.mesh_polls.held() == 0
