"""Every ``{id}`` in a path also takes a name or a unique id prefix of 8+ characters, through
one resolver in the routing layer, limited to what the caller's token may see."""

from __future__ import annotations

from metald.auth import Principal, Role
from metald.store.models import Bmc, Machine

TWIN_A = "abcdef01-0000-4000-8000-000000000001"
TWIN_B = "abcdef01-1111-4000-8000-000000000002"


def _twins(store, tenant_id: str | None = None) -> None:  # type: ignore[no-untyped-def]
    with store.session() as s:
        s.add(Machine(id=TWIN_A, name="twin-a", state="discovered", labels={}, tenant_id=tenant_id))
        s.add(Machine(id=TWIN_B, name="twin-b", state="discovered", labels={}))
        s.commit()


async def test_machine_by_name_and_by_prefix(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    tech = tokens.header("technician")
    r = await client.get("/api/v1/machines/node2", headers=tech)
    assert r.status == 200 and (await r.json())["id"] == tokens.machine_free
    r = await client.get(f"/api/v1/machines/{tokens.machine_free[:8]}", headers=tech)
    assert r.status == 200 and (await r.json())["id"] == tokens.machine_free
    # Writes resolve the same way (the action lands on the named machine).
    r = await client.post(
        "/api/v1/machines/node2/actions", json={"action": "maintenance-on"}, headers=tech
    )
    assert r.status == 200 and (await r.json())["id"] == tokens.machine_free
    # Shorter than 8 characters is not a prefix: the route's own 404.
    r = await client.get(f"/api/v1/machines/{tokens.machine_free[:7]}", headers=tech)
    assert r.status == 404


async def test_ambiguous_prefix_is_409_listing_the_matches(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    _twins(store)
    r = await client.get("/api/v1/machines/abcdef01", headers=tokens.header("admin"))
    assert r.status == 409
    body = await r.json()
    assert body["matches"] == [TWIN_A, TWIN_B] and "more of the id" in body["detail"]
    r = await client.get("/api/v1/machines/abcdef01-1", headers=tokens.header("admin"))
    assert (await r.json())["id"] == TWIN_B


async def test_scoped_tokens_resolve_only_what_they_see(api) -> None:  # type: ignore[no-untyped-def]
    """An orchestrator neither resolves another tenant's machine by name nor learns from a 409
    that an invisible machine shares a prefix with its own."""
    client, tokens, store = api
    _twins(store, tenant_id=tokens.tenant_a)  # twin-a is tenant A's, twin-b nobody's
    orch = tokens.header("orchestrator")
    r = await client.get("/api/v1/machines/node1", headers=orch)  # tenant B's
    assert r.status == 404
    r = await client.get("/api/v1/machines/abcdef01", headers=orch)
    assert r.status == 200 and (await r.json())["id"] == TWIN_A
    r = await client.get("/api/v1/machines/twin-b", headers=orch)
    assert r.status == 404
    r = await client.get("/api/v1/tenants/globex", headers=orch)
    assert r.status == 404
    r = await client.get("/api/v1/tenants/acme", headers=orch)
    assert r.status == 200 and (await r.json())["id"] == tokens.tenant_a


async def test_tenants_images_and_claims_resolve(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    admin = tokens.header("admin")
    r = await client.get("/api/v1/tenants/globex", headers=admin)
    assert (await r.json())["id"] == tokens.tenant_b
    r = await client.get(f"/api/v1/tenants/{tokens.tenant_b[:10]}", headers=admin)
    assert (await r.json())["id"] == tokens.tenant_b
    r = await client.post(
        "/api/v1/images",
        json={"name": "ram", "kind": "stateless", "kernel": "n/vmlinuz", "rootfs": "n/root.sq"},
        headers=admin,
    )
    image_id = (await r.json())["id"]
    r = await client.get("/api/v1/images/ram", headers=admin)
    assert (await r.json())["id"] == image_id


def test_bmcs_and_claims_resolve_by_prefix_only(store) -> None:  # type: ignore[no-untyped-def]
    from api.resolve import resolve

    admin = Principal(token_id="t", name="a", role=Role.ADMIN)
    orch = Principal(token_id="t", name="o", role=Role.ORCHESTRATOR, scope=frozenset({"x"}))
    with store.session() as s:
        b = Bmc(address="192.0.2.9", protocol="ipmi", username="u", password_enc=b"x")
        s.add(b)
        s.commit()
        assert resolve(s, admin, "bmcs", b.id[:8]) == b.id
        assert resolve(s, orch, "bmcs", b.id[:8]) == b.id[:8]  # not theirs: unresolved
        assert resolve(s, admin, "bmcs", "192.0.2.9") == "192.0.2.9"  # BMCs have no name
        assert resolve(s, admin, "claims", "%%%%%%%%") == "%%%%%%%%"  # no LIKE wildcards


async def test_openapi_path_parameters_are_id_and_tags_plural(api) -> None:  # type: ignore[no-untyped-def]
    client, _, _ = api
    doc = await (await client.get("/api/v1/openapi.json")).json()
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            names = [p["name"] for p in op.get("parameters", []) if p["in"] == "path"]
            assert all(n == "id" or n.endswith("_id") for n in names), (path, names)
            if "/bmcs/" in path:  # the BMC is {id}; a sub-resource names its own (command_id)
                assert names[0] == "id" and "bmc_id" not in names, path
            assert op["tags"] and op["tags"][0] != "bmc", (path, method)
    ids = {op["operationId"] for ops in doc["paths"].values() for op in ops.values()}
    assert "prometheus" not in ids and "event_log" not in ids


async def test_rename_a_machine_and_find_it_by_its_new_name(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    tech = tokens.header("technician")
    r = await client.patch(
        f"/api/v1/machines/{tokens.machine_free}", json={"name": "r07-u12"}, headers=tech
    )
    assert r.status == 200 and (await r.json())["name"] == "r07-u12"
    r = await client.get("/api/v1/machines/r07-u12", headers=tech)
    assert (await r.json())["id"] == tokens.machine_free
    r = await client.patch("/api/v1/machines/node0", json={"name": "r07-u12"}, headers=tech)
    assert r.status == 409 and "already named" in (await r.json())["detail"]
    r = await client.patch("/api/v1/machines/node0", json={"name": TWIN_A}, headers=tech)
    assert r.status == 422
    r = await client.patch(
        "/api/v1/machines/r07-u12", json={"name": "x"}, headers=tokens.header("orchestrator")
    )
    assert r.status == 403


def test_default_name_from_rack_position(store) -> None:  # type: ignore[no-untyped-def]
    from metald import machines

    with store.session() as s:
        m = machines.create_machine(
            s, macs=["02:00:00:00:99:01"], actor="t", rack="r07", rack_position="sw1/eth 12"
        )
        assert m.name == "r07-sw1-eth-12"
        # The same position again (a moved machine not yet renamed): a generated name rather
        # than a clash (issue 31: it was left unnamed, "-" everywhere).
        m2 = machines.create_machine(
            s, macs=["02:00:00:00:99:02"], actor="t", rack="r07", rack_position="sw1/eth 12"
        )
        assert m2.name is not None and machines.is_generated_name(m2)
        assert machines.default_name(None, None) is None
        assert machines.default_name(None, "///") is None


async def test_concurrent_rename_to_the_same_name_is_409_not_500(api) -> None:  # type: ignore[no-untyped-def]
    """Two renames to one name: the second passes the "is it taken" check, then another
    writer commits that name before its UPDATE lands. The unique index refuses the UPDATE;
    the answer is a 409 problem that says what to do, and nothing is half-written."""
    from sqlalchemy import event

    client, tokens, store = api
    tech = tokens.header("technician")
    fired: list[str] = []

    def rival(conn, cursor, statement, params, context, executemany):  # type: ignore[no-untyped-def]
        if not fired and statement.lstrip().upper().startswith("UPDATE MACHINES"):
            fired.append(statement)
            # The rival rename, on the same connection just before ours (as if it had
            # committed in between): another machine takes the name first.
            cursor.execute(
                f"UPDATE machines SET name = 'contested' WHERE id = '{tokens.machine_a}'"
            )

    event.listen(store.engine, "before_cursor_execute", rival)
    try:
        r = await client.patch("/api/v1/machines/node2", json={"name": "contested"}, headers=tech)
    finally:
        event.remove(store.engine, "before_cursor_execute", rival)
    assert fired, "the rename never reached its UPDATE"
    assert r.status == 409, await r.text()
    body = await r.json()
    assert r.content_type == "application/problem+json" and "pick another name" in body["detail"]
    r = await client.get("/api/v1/machines/node2", headers=tech)
    assert (await r.json())["name"] == "node2"  # the losing rename left nothing behind


async def test_references_in_bodies_and_filters_take_what_a_path_takes(api) -> None:  # type: ignore[no-untyped-def]
    """docs/client.md's ``c.claim(tenant="acme", ...)`` answered 404 and an image name 422:
    every reference in a body or a filter now takes an id, a name or an 8+ character prefix."""
    client, tokens, store = api
    admin = tokens.header("admin")
    r = await client.post(
        "/api/v1/images",
        json={
            "name": "ram",
            "kind": "stateless",
            "kernel": "n/vmlinuz",
            "rootfs": "n/root.sq",
            "tenants": ["acme", tokens.tenant_b[:8]],
        },
        headers=admin,
    )
    assert r.status == 201, await r.text()
    image = await r.json()
    assert sorted(image["tenants"]) == sorted([tokens.tenant_a, tokens.tenant_b])
    r = await client.post(
        "/api/v1/claims",
        json={"tenant_id": "acme", "image_id": "ram", "count": 1},
        headers=admin,
    )
    assert r.status in (201, 202), await r.text()
    claim = await r.json()
    assert (claim["tenant_id"], claim["image_id"]) == (tokens.tenant_a, image["id"])
    r = await client.get("/api/v1/claims?tenant_id=acme", headers=admin)
    assert [c["id"] for c in (await r.json())["items"]] == [claim["id"]]
    r = await client.post(
        "/api/v1/tokens",
        json={"name": "ci", "role": "orchestrator", "scope": ["globex"]},
        headers=admin,
    )
    assert r.status == 201 and (await r.json())["scope"] == [tokens.tenant_b]
    r = await client.get("/api/v1/events?machine_id=node2&limit=1", headers=admin)
    assert r.status == 200
    assert all(e["machine_id"] == tokens.machine_free for e in (await r.json())["items"])
    # The BMC bodies mark their machine the same way (this app runs no BMC service).
    from api.resolve import ref_fields
    from api.routes_bmc import BmcCreate, BmcLink

    assert ref_fields(BmcLink) == ref_fields(BmcCreate) == {"machine_id": ("machines", False)}


async def test_a_too_short_prefix_says_at_least_8_characters(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    admin = tokens.header("admin")
    r = await client.get(f"/api/v1/machines/{tokens.machine_free[:7]}", headers=admin)
    assert r.status == 404 and "at least 8 characters" in (await r.json())["detail"]
    # In a body it is an invalid field (422, every body route's answer to one), named.
    r = await client.post(
        "/api/v1/claims",
        json={"tenant_id": tokens.tenant_a[:6], "image_id": "x", "count": 1},
        headers=admin,
    )
    detail = (await r.json())["detail"]
    assert r.status == 422 and "tenant_id:" in detail and "at least 8 characters" in detail
    r = await client.post(
        "/api/v1/tokens",
        json={"name": "ci", "role": "orchestrator", "scope": ["abc"]},
        headers=admin,
    )
    detail = (await r.json())["detail"]
    assert r.status == 422 and "scope:" in detail and "at least 8 characters" in detail
