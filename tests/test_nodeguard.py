"""Tenant machines reach only metald's join, agent and boot endpoints (metald/nodeguard.py)."""

from __future__ import annotations

from api.app import CTX_KEY
from metald.nodeguard import TenantNodeGuard, path_allowed, tenant_node_addresses
from tests.api_helpers import use_services
from tests.dhcp_leases import add_lease

# seed(): node0 (52:54:00:00:00:01) is tenant A's, node1 (...:02) tenant B's, node2 (...:03) free.


async def test_addresses_are_bound_leases_of_allocated_machines(api) -> None:  # type: ignore[no-untyped-def]
    _client, _tokens, store = api
    add_lease(store, "52:54:00:00:00:01", "10.0.0.11")  # tenant A's machine
    add_lease(store, "52:54:00:00:00:02", "10.0.0.12", ttl_s=-5)  # B's, lease expired
    add_lease(store, "52:54:00:00:00:03", "10.0.0.13")  # the free machine
    add_lease(store, "52:54:00:00:00:02", "10.0.0.14", state="offered")  # not bound
    add_lease(store, "52:54:00:00:00:99", "10.0.0.15")  # no machine
    with store.session() as s:
        assert tenant_node_addresses(s) == {"10.0.0.11"}


def test_allowed_paths() -> None:
    for p in ("/api/v1/join", "/api/v1/agent/progress", "/boot/52:54:00:00:00:01.ipxe"):
        assert path_allowed(p)
    for p in ("/api/v1/machines", "/api/v1/tokens", "/healthz", "/metrics", "/api/v1/joinx"):
        assert not path_allowed(p)


async def test_tenant_machine_gets_403_beyond_join_and_agent(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    guard = TenantNodeGuard(store)
    use_services(client.server.app[CTX_KEY], tenant_node_guard=guard)
    admin = tokens.header("admin")

    # The test client speaks from 127.0.0.1: make that tenant A's machine's lease.
    assert (await client.get("/api/v1/machines", headers=admin)).status == 200
    add_lease(store, "52:54:00:00:00:01", "127.0.0.1")
    await guard.refresh()
    assert guard.addresses == {"127.0.0.1"}

    r = await client.get("/api/v1/machines", headers=admin)  # even with an admin token
    assert r.status == 403 and r.content_type == "application/problem+json"
    assert "/api/v1/join" in (await r.json())["detail"]
    assert (await client.get("/healthz")).status == 403
    assert (await client.get("/api/v1/tokens", headers=admin)).status == 403
    # The join and agent endpoints answer as ever (here: no or a bad token).
    assert (await client.post("/api/v1/join", json={})).status in (401, 422)
    r = await client.get("/api/v1/agent/next", headers=tokens.header("agent"))
    assert r.status == 200
    assert guard.refused == 3

    # Released (no tenant any more): the next refresh lets it through again.
    with store.session() as s:
        from metald.store.models import Machine

        m = s.get(Machine, tokens.machine_a)
        m.tenant_id = None
        s.add(m)
        s.commit()
    await guard.refresh()
    assert (await client.get("/api/v1/machines", headers=admin)).status == 200


async def test_dot_segments_do_not_slip_past(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    guard = TenantNodeGuard(store)
    use_services(client.server.app[CTX_KEY], tenant_node_guard=guard)
    add_lease(store, "52:54:00:00:00:01", "127.0.0.1")
    await guard.refresh()
    for raw in (
        "/api/v1/agent/../machines",
        "/boot/../api/v1/machines",
        "/api/v1/agent/%2e%2e/machines",
    ):
        r = await client.get(raw, headers=tokens.header("admin"))
        assert r.status in (403, 404), (raw, r.status)
