"""The HTTP API: authorisation matrix, scopes, bad input, events, OpenAPI. Both backends."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from sqlmodel import func, select

from api.app import ROUTERS, all_specs
from metald.store.models import ApiToken, Event, Machine

ROLES = ["admin", "technician", "orchestrator", "agent"]
SPECS = [s for s in all_specs(ROUTERS)]


def _path(spec_path: str, tokens) -> str:  # type: ignore[no-untyped-def]
    # Fill path parameters with ids every scoped role can legitimately name where possible.
    out = spec_path.replace("{id}", tokens.machine_a) if "/machines/" in spec_path else spec_path
    out = out.replace("{id}", tokens.tenant_a) if "/tenants/" in out else out
    return re.sub(r"{\w+(:[^}]*)?}", "does-not-exist", out)


def _snapshot(store):  # type: ignore[no-untyped-def]
    with store.session() as s:
        return (
            s.exec(select(func.count()).select_from(Event)).one(),
            sorted(
                (m.id, m.state, m.version, json.dumps(m.labels, sort_keys=True))
                for m in s.exec(select(Machine))
            ),
            s.exec(select(func.count()).select_from(ApiToken)).one(),
        )


async def test_every_endpoint_every_role(api) -> None:  # type: ignore[no-untyped-def]
    """Every declared route against no token, a bad token, and each role: roles outside the
    route's list get 403 and change nothing; roles inside never get 401/403."""
    client, tokens, store = api
    seen = 0
    for spec in SPECS:
        if spec.raw_response == "text/event-stream":
            continue  # streams are covered by their own test (they do not end)
        path = _path(spec.path, tokens)
        body = {} if spec.body is not None else None
        if spec.roles is None:
            r = await client.request(spec.method, path)
            if spec.body is not None:  # authenticated by its body (a one-time join token)
                assert r.status in (400, 401, 415, 422), (spec.method, spec.path, r.status)
            else:
                assert r.status < 400, (spec.method, spec.path, r.status)
            continue
        r = await client.request(spec.method, path, json=body)
        assert r.status == 401, (spec.method, spec.path)
        assert r.headers["Content-Type"].startswith("application/problem+json")
        r = await client.request(
            spec.method, path, json=body, headers={"Authorization": "Bearer mtd_forged"}
        )
        assert r.status == 401
        for role in ROLES:
            before = _snapshot(store)
            r = await client.request(spec.method, path, json=body, headers=tokens.header(role))
            if spec.roles and role not in {x.value for x in spec.roles}:
                assert r.status == 403, (spec.method, spec.path, role, r.status)
                problem = await r.json(content_type=None)
                assert role in problem["detail"]
                assert _snapshot(store) == before
            else:
                assert r.status not in (401, 403), (spec.method, spec.path, role, r.status)
            seen += 1
    assert seen >= 4 * 12


async def test_orchestrator_sees_only_its_tenants(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    r = await client.get("/api/v1/machines", headers=tokens.header("orchestrator"))
    page = await r.json()
    assert [m["id"] for m in page["items"]] == [tokens.machine_a]
    r = await client.get(
        f"/api/v1/machines/{tokens.machine_b}", headers=tokens.header("orchestrator")
    )
    assert r.status == 404
    r = await client.get(
        f"/api/v1/machines/{tokens.machine_b}", headers=tokens.header("orchestrator_other")
    )
    assert r.status == 200
    r = await client.get("/api/v1/events", headers=tokens.header("orchestrator"))
    evs = (await r.json())["items"]
    assert evs and all(e["tenant_id"] == tokens.tenant_a for e in evs)
    r = await client.get("/api/v1/tenants", headers=tokens.header("orchestrator"))
    assert [t["id"] for t in (await r.json())["items"]] == [tokens.tenant_a]
    r = await client.get(
        f"/api/v1/tenants/{tokens.tenant_b}", headers=tokens.header("orchestrator")
    )
    assert r.status == 404


async def test_agent_sees_only_its_machine(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    r = await client.get("/api/v1/machines", headers=tokens.header("agent"))
    assert [m["id"] for m in (await r.json())["items"]] == [tokens.machine_a]
    for other in (tokens.machine_b, tokens.machine_free):
        r = await client.get(f"/api/v1/machines/{other}", headers=tokens.header("agent"))
        assert r.status == 404
    r = await client.get("/api/v1/events", headers=tokens.header("agent"))
    assert r.status == 403


BAD_REQUESTS = [
    # (description, method, path, kwargs, status, phrase in detail)
    (
        "malformed json",
        "POST",
        "/api/v1/machines",
        {"data": b"{not json", "headers": {"Content-Type": "application/json"}},
        400,
        "not valid JSON",
    ),
    ("json array", "POST", "/api/v1/machines", {"json": [1, 2]}, 400, "JSON object"),
    (
        "unknown field",
        "POST",
        "/api/v1/machines",
        {"json": {"macs": ["02:00:00:00:09:01"], "colour": "red"}},
        422,
        "colour: unknown field",
    ),
    (
        "wrong type",
        "POST",
        "/api/v1/machines",
        {"json": {"macs": "02:00:00:00:09:01"}},
        422,
        "macs",
    ),
    ("missing field", "POST", "/api/v1/machines", {"json": {}}, 422, "macs: is required"),
    (
        "bad mac",
        "POST",
        "/api/v1/machines",
        {"json": {"macs": ["zz:00:00:00:00:01"]}},
        422,
        "not a MAC",
    ),
    (
        "duplicate mac",
        "POST",
        "/api/v1/machines",
        {"json": {"macs": ["52:54:00:00:00:01"]}},
        409,
        "already belongs",
    ),
    (
        "oversized",
        "POST",
        "/api/v1/machines",
        {
            "data": b'{"macs": ["' + b"a" * (2 << 20) + b'"]}',
            "headers": {"Content-Type": "application/json"},
        },
        413,
        "limit",
    ),
    (
        "form body",
        "POST",
        "/api/v1/machines",
        {"data": b"macs=1", "headers": {"Content-Type": "application/x-www-form-urlencoded"}},
        415,
        "application/json",
    ),
    ("unknown machine", "GET", "/api/v1/machines/nope", {}, 404, "no machine"),
    (
        "unknown action",
        "POST",
        "/api/v1/machines/{free}/actions",
        {"json": {"action": "explode"}},
        422,
        "action",
    ),
    (
        "illegal transition",
        "POST",
        "/api/v1/machines/{a}/actions",
        {"json": {"action": "retire"}},
        409,
        "release it first",
    ),
    (
        "stale version",
        "POST",
        "/api/v1/machines/{free}/actions",
        {"json": {"action": "maintenance-on", "version": 1}},
        409,
        "changed since it was read",
    ),
    (
        "bad label key",
        "PATCH",
        "/api/v1/machines/{free}/labels",
        {"json": {"labels": {"bad key!": "x"}}},
        422,
        "labels",
    ),
    ("bad filter", "GET", "/api/v1/machines?state=flying", {}, 422, "state"),
    ("bad label filter", "GET", "/api/v1/machines?label=novalue", {}, 422, "key=value"),
    ("unknown query param", "GET", "/api/v1/machines?colour=red", {}, 422, "colour"),
    ("negative limit", "GET", "/api/v1/machines?limit=-1", {}, 422, "limit"),
    ("unknown route", "GET", "/api/v1/nothing-here", {}, 404, "no resource"),
    ("wrong method", "DELETE", "/api/v1/machines", {}, 405, "not allowed"),
    (
        "token scope to missing tenant",
        "POST",
        "/api/v1/tokens",
        {"json": {"name": "o", "role": "orchestrator", "scope": ["nope"]}},
        422,
        "do not exist",
    ),
    (
        "agent token without machine",
        "POST",
        "/api/v1/tokens",
        {"json": {"name": "a", "role": "agent"}},
        422,
        "exactly one machine",
    ),
    ("revoke self", "DELETE", "/api/v1/tokens/{admin_id}", {}, 409, "refusing"),
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
async def test_bad_input_gets_problem_and_changes_nothing(api, case) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    _desc, method, path, kwargs, status, phrase = case
    kwargs = dict(kwargs)
    r = await client.get("/api/v1/whoami", headers=tokens.header("admin"))
    admin_id = (await r.json())["token_id"]
    path = path.format(free=tokens.machine_free, a=tokens.machine_a, admin_id=admin_id)
    before = _snapshot(store)
    headers = {**tokens.header("admin"), **kwargs.pop("headers", {})}
    r = await client.request(method, path, headers=headers, **kwargs)
    assert r.status == status
    assert r.headers["Content-Type"].startswith("application/problem+json")
    body = await r.json(content_type=None)
    assert body["status"] == status and body["title"] and phrase in body["detail"], body
    assert _snapshot(store) == before


async def test_actions_labels_filters_and_pagination(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    h = tokens.header("technician")
    r = await client.patch(
        f"/api/v1/machines/{tokens.machine_free}/labels",
        json={"labels": {"pool": "train", "gen": "h100"}},
        headers=h,
    )
    assert r.status == 200 and (await r.json())["labels"] == {"pool": "train", "gen": "h100"}
    r = await client.patch(
        f"/api/v1/machines/{tokens.machine_free}/labels", json={"labels": {"gen": None}}, headers=h
    )
    assert (await r.json())["labels"] == {"pool": "train"}
    r = await client.get("/api/v1/machines?label=pool=train", headers=h)
    assert [m["id"] for m in (await r.json())["items"]] == [tokens.machine_free]
    r = await client.get("/api/v1/machines?min_gpu_count=7", headers=h)
    assert {m["id"] for m in (await r.json())["items"]} == {tokens.machine_a, tokens.machine_b}
    r = await client.get("/api/v1/machines?gpu_count=6&gpu_model=NVIDIA H100 80GB HBM3", headers=h)
    assert [m["id"] for m in (await r.json())["items"]] == [tokens.machine_free]
    r = await client.get("/api/v1/machines?state=claimed&state=ready", headers=h)
    assert (await r.json())["total"] == 3
    r = await client.get("/api/v1/machines?limit=2&offset=2", headers=h)
    page = await r.json()
    assert page["total"] == 3 and len(page["items"]) == 1
    for action, state in [
        ("maintenance-on", "maintenance"),
        ("maintenance-off", "ready"),
        ("mark-broken", "broken"),
        ("repair", "maintenance"),
        ("retire", "retired"),
    ]:
        r = await client.post(
            f"/api/v1/machines/{tokens.machine_free}/actions",
            json={"action": action, "reason": "test"},
            headers=h,
        )
        assert r.status == 200, await r.text()
        assert (await r.json())["state"] == state
    r = await client.get(f"/api/v1/events?machine_id={tokens.machine_free}", headers=h)
    kinds = [(e["kind"], e["to_state"]) for e in (await r.json())["items"]]
    assert ("machine.state", "retired") in kinds and ("machine.labels", None) in kinds


async def test_token_lifecycle(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    r = await client.post(
        "/api/v1/tokens", json={"name": "ops", "role": "technician"}, headers=tokens.header("admin")
    )
    assert r.status == 201
    created = await r.json()
    secret = created["token"]
    r = await client.get("/api/v1/tokens", headers=tokens.header("admin"))
    listing = await r.text()
    assert secret not in listing and "token_hash" not in listing
    r = await client.get("/api/v1/whoami", headers={"Authorization": f"Bearer {secret}"})
    assert (await r.json())["role"] == "technician"
    r = await client.delete(f"/api/v1/tokens/{created['id']}", headers=tokens.header("admin"))
    assert r.status == 200
    r = await client.get("/api/v1/whoami", headers={"Authorization": f"Bearer {secret}"})
    assert r.status == 401


async def test_event_stream_delivers_live_events(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    r = await client.get("/api/v1/events", headers=tokens.header("admin"))
    cursor = (await r.json())["next_after"]
    stream = await client.get(
        f"/api/v1/events/stream?after={cursor}", headers=tokens.header("technician")
    )
    assert stream.headers["Content-Type"] == "text/event-stream"
    await client.post(
        f"/api/v1/machines/{tokens.machine_free}/actions",
        json={"action": "maintenance-on"},
        headers=tokens.header("technician"),
    )

    async def first_event() -> dict:
        data = None
        async for raw in stream.content:
            line = raw.decode().strip()
            if line.startswith("data:"):
                data = json.loads(line[5:])
            elif not line and data:
                return data
        raise AssertionError("stream ended")

    ev = await asyncio.wait_for(first_event(), 10)
    assert ev["machine_id"] == tokens.machine_free and ev["to_state"] == "maintenance"
    stream.close()


async def test_openapi_is_generated_from_routes(api) -> None:  # type: ignore[no-untyped-def]
    client, _, _ = api
    doc = await (await client.get("/api/v1/openapi.json")).json()
    declared = {(s.openapi_path, s.method.lower()) for s in SPECS}
    documented = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert declared == documented
    op = doc["paths"]["/api/v1/machines/{id}/actions"]["post"]
    assert op["x-roles"] == ["admin", "technician"]
    assert "409" in op["responses"] and "requestBody" in op
    schema_name = op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[
        1
    ]
    assert "retire" in json.dumps(doc["components"]["schemas"][schema_name])


async def test_health_and_metrics(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    r = await client.get("/healthz")
    assert r.status == 200 and (await r.json())["database"] == "ok"
    await client.get("/api/v1/machines", headers=tokens.header("admin"))
    text = await (await client.get("/metrics")).text()
    assert 'metald_machines{state="claimed"} 2.0' in text
    assert "metald_api_requests_total" in text


def test_docs_api_md_is_current() -> None:
    from pathlib import Path

    from api.docs import render

    doc = Path(__file__).parent.parent / "docs" / "api.md"
    assert doc.read_text() == render(), "docs/api.md is stale: run python -m api.docs > docs/api.md"
