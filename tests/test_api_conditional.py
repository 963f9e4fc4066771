"""Conditional updates the HTTP way: a versioned resource answers its version as ``ETag``, and
a write sent with ``If-Match`` happens only at that version (412 otherwise), beside the body
``version`` that keeps answering 409."""

from __future__ import annotations

from api.app import CTX_KEY
from tests.api_helpers import drain_steps, use_services
from tests.claims.fakes import FakeBmc
from tests.claims.helpers import DISK_SPEC, add_ready


async def test_machine_etag_and_if_match(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    tech = tokens.header("technician")
    url = f"/api/v1/machines/{tokens.machine_free}"
    r = await client.get(url, headers=tech)
    tag = r.headers["ETag"]
    assert tag == f'"{(await r.json())["version"]}"'

    stale = {**tech, "If-Match": '"999"'}
    r = await client.patch(f"{url}/labels", json={"labels": {"a": "1"}}, headers=stale)
    assert r.status == 412, await r.text()
    assert r.headers["Content-Type"].startswith("application/problem+json")
    assert "a" not in (await (await client.get(url, headers=tech)).json())["labels"]

    r = await client.patch(
        f"{url}/labels", json={"labels": {"a": "1"}}, headers={**tech, "If-Match": tag}
    )
    assert r.status == 200 and r.headers["ETag"] != tag
    # The old tag no longer holds: the same write conditional on it is refused.
    r = await client.post(
        f"{url}/actions", json={"action": "maintenance-on"}, headers={**tech, "If-Match": tag}
    )
    assert r.status == 412
    # The body version still works as before (409 when stale) and * matches any version.
    r = await client.post(
        f"{url}/actions", json={"action": "maintenance-on", "version": 1}, headers=tech
    )
    assert r.status == 409
    r = await client.post(
        f"{url}/actions", json={"action": "maintenance-on"}, headers={**tech, "If-Match": "*"}
    )
    assert r.status == 200, await r.text()


async def test_if_match_and_body_version_must_agree(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    tech = tokens.header("technician")
    url = f"/api/v1/machines/{tokens.machine_free}"
    v = (await (await client.get(url, headers=tech)).json())["version"]
    r = await client.patch(
        f"{url}/labels",
        json={"labels": {"a": "1"}, "version": v},
        headers={**tech, "If-Match": f'"{v + 1}"'},
    )
    assert r.status == 412 and "send one of them" in (await r.json())["detail"]


async def test_if_match_on_a_resource_without_version_is_refused(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    r = await client.post(
        "/api/v1/tenants",
        json={"name": "cond"},
        headers={**tokens.header("admin"), "If-Match": '"1"'},
    )
    assert r.status == 412
    r = await client.get("/api/v1/tenants", headers=tokens.header("admin"))
    assert "cond" not in [t["name"] for t in (await r.json())["items"]]


async def test_malformed_if_match_is_412(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    url = f"/api/v1/machines/{tokens.machine_free}/labels"
    for bad in ("3", 'W/"3"', '"1", "2"'):
        r = await client.patch(
            url, json={"labels": {"a": "1"}}, headers={**tokens.header("admin"), "If-Match": bad}
        )
        assert r.status == 412, bad


async def test_claim_etag_and_if_match_on_release(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    use_services(client.server.app[CTX_KEY], bmc=FakeBmc(power_state="off"))
    r = await client.post(
        "/api/v1/images",
        json={"name": "node", "kind": "disk", **DISK_SPEC},
        headers=tokens.header("technician"),
    )
    image_id = (await r.json())["id"]
    add_ready(store, 1, labels={"pool": "c"})
    orch = tokens.header("orchestrator")
    r = await client.post(
        "/api/v1/claims",
        json={
            "tenant_id": tokens.tenant_a,
            "count": 1,
            "selector": {"labels": {"pool": "c"}},
            "image_id": image_id,
        },
        headers=orch,
    )
    assert r.status == 201, await r.text()
    claim = await r.json()
    await drain_steps(client)  # provisioning steps bump the claim's version; let them finish
    r = await client.get(f"/api/v1/claims/{claim['id']}", headers=orch)
    tag = r.headers["ETag"]
    assert tag == f'"{(await r.json())["version"]}"'
    r = await client.post(
        f"/api/v1/claims/{claim['id']}/release", headers={**orch, "If-Match": '"999"'}
    )
    assert r.status == 412, await r.text()
    r = await client.get(f"/api/v1/claims/{claim['id']}", headers=orch)
    assert (await r.json())["state"] == "allocated"
    r = await client.post(
        f"/api/v1/claims/{claim['id']}/release", headers={**orch, "If-Match": tag}
    )
    assert r.status == 200, await r.text()
    assert (await r.json())["state"] != "allocated"


async def test_openapi_documents_etag_and_if_match(api) -> None:  # type: ignore[no-untyped-def]
    client, _, _ = api
    doc = await (await client.get("/api/v1/openapi.json")).json()
    show = doc["paths"]["/api/v1/machines/{id}"]["get"]["responses"]["200"]
    assert "ETag" in show["headers"]
    patch = doc["paths"]["/api/v1/machines/{id}/labels"]["patch"]
    assert any(p["name"] == "If-Match" and p["in"] == "header" for p in patch["parameters"])
    assert "412" in patch["responses"]
