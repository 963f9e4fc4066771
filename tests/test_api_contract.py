"""The API's HTTP contract as a strict generated client reads it: 201 + Location on creation,
405 + Allow, the documented status is the one sent, RFC 9457 ``about:blank`` problem types,
RFC 3339 timestamps with their offset, and a document that openapi-spec-validator accepts."""

from __future__ import annotations

from datetime import datetime

import pytest
from openapi_spec_validator import validate

from api.app import ROUTERS, all_specs
from api.routing import RouteSpec, _serialize

SPECS = list(all_specs(ROUTERS))
#: 201 routes that create nothing addressable, so they send no Location: a join token is a
#: one-time secret, not a resource with a path.
NO_LOCATION = {("POST", "/api/v1/machines/{id}/join-token")}


async def test_openapi_document_is_valid_openapi(api) -> None:  # type: ignore[no-untyped-def]
    client, _, _ = api
    doc = await (await client.get("/api/v1/openapi.json")).json()
    validate(doc)  # raises on any violation of the OpenAPI 3.1 schema


def test_every_creating_route_declares_its_location() -> None:
    missing = [
        (s.method, s.openapi_path)
        for s in SPECS
        if s.status == 201 and s.location is None and (s.method, s.openapi_path) not in NO_LOCATION
    ]
    assert missing == []


async def test_post_that_creates_answers_201_with_a_location_that_resolves(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    admin = tokens.header("admin")
    for path, body in (
        ("/api/v1/machines", {"macs": ["02:00:00:00:77:01"], "name": "loc-test"}),
        ("/api/v1/tenants", {"name": "loc-tenant"}),
    ):
        r = await client.post(path, json=body, headers=admin)
        assert r.status == 201, await r.text()
        created = await r.json()
        assert r.headers["Location"] == f"{path}/{created['id']}"
        got = await client.get(r.headers["Location"], headers=admin)
        assert got.status == 200 and (await got.json())["id"] == created["id"]
    r = await client.post("/api/v1/tokens", json={"name": "x", "role": "technician"}, headers=admin)
    assert r.status == 201 and r.headers["Location"] == f"/api/v1/tokens/{(await r.json())['id']}"


async def test_created_location_is_documented(api) -> None:  # type: ignore[no-untyped-def]
    client, _, _ = api
    doc = await (await client.get("/api/v1/openapi.json")).json()
    created = doc["paths"]["/api/v1/machines"]["post"]["responses"]["201"]
    assert "Location" in created["headers"]


async def test_405_carries_allow(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    r = await client.put("/api/v1/machines", headers=tokens.header("admin"))
    assert r.status == 405
    assert set(r.headers["Allow"].split(", ")) == {"GET", "POST"}
    assert r.headers["Content-Type"].startswith("application/problem+json")


async def test_problem_type_is_about_blank(api) -> None:  # type: ignore[no-untyped-def]
    """RFC 9457 4.2.1: metald's problems carry no semantics beyond the status code (the
    sentence is in ``detail``), so ``type`` is about:blank rather than a URI nobody serves."""
    client, tokens, _ = api
    for r in (
        await client.get("/api/v1/machines"),
        await client.get("/api/v1/machines/nope", headers=tokens.header("admin")),
        await client.get("/api/v1/nothing-here"),
    ):
        body = await r.json(content_type=None)
        assert body["type"] == "about:blank" and body["status"] == r.status


async def test_documented_status_is_the_status_sent(api) -> None:  # type: ignore[no-untyped-def]
    client, _, _ = api
    doc = await (await client.get("/api/v1/openapi.json")).json()
    for s in SPECS:
        responses = doc["paths"][s.openapi_path][s.method.lower()]["responses"]
        assert str(s.status) in responses, (s.method, s.openapi_path)
        assert s.status == 204 or s.response or s.raw_response, (s.method, s.openapi_path)
    remove = doc["paths"]["/api/v1/bmcs/{id}"]["delete"]["responses"]
    assert "204" in remove and "200" not in remove and "content" not in remove["204"]


async def _noop(_req):  # type: ignore[no-untyped-def]
    return None


def test_a_route_cannot_send_a_status_it_does_not_declare() -> None:
    """A handler that answers nothing on a route declaring 200 is a bug the document would
    hide (it used to be turned into an undocumented 204); it fails loudly instead."""
    spec = RouteSpec("DELETE", "/x", _noop, "x", None)
    with pytest.raises(RuntimeError, match="declares 200"):
        _serialize(spec, None, {})
    assert (
        _serialize(RouteSpec("DELETE", "/x", _noop, "x", None, status=204), None, {}).status == 204
    )


async def test_timestamps_are_rfc3339_with_offset(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    admin = tokens.header("admin")
    bodies = [
        await (await client.get(f"/api/v1/machines/{tokens.machine_a}", headers=admin)).json(),
        await (await client.get("/api/v1/events?limit=5", headers=admin)).json(),
        await (await client.get("/api/v1/tokens", headers=admin)).json(),
    ]
    stamps: list[str] = []

    def walk(v: object, key: str = "") -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, k)
        elif isinstance(v, list):
            for x in v:
                walk(x, key)
        elif isinstance(v, str) and (key.endswith("_at") or key in ("at", "ts")):
            stamps.append(v)

    walk(bodies)
    assert stamps
    for s in stamps:
        assert datetime.fromisoformat(s).utcoffset() is not None, s
        assert s.endswith("+00:00") or s.endswith("Z"), s
