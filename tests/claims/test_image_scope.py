"""Images carry credentials (userinfo, pre-signed query strings): only admins read them back,
and an image scoped to tenants is seen and claimed by their orchestrators only."""

from __future__ import annotations

from metald.provision.redact import REDACTED, redact_spec, redact_url

SIGNED = (
    "https://mirror:hunter2@objects.example/node.raw.gz"
    "?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA123&X-Amz-Signature=deadbeef"
    "&X-Amz-Expires=3600"
)
SHA = "a" * 64


def test_redact_url_forms() -> None:
    out = redact_url(SIGNED)
    assert "hunter2" not in out and "mirror" not in out.split("@")[0]
    assert "deadbeef" not in out and "AKIA123" not in out
    assert "X-Amz-Algorithm=AWS4-HMAC-SHA256" in out and "X-Amz-Expires=3600" in out
    assert out.startswith(f"https://{REDACTED}@objects.example/node.raw.gz?")
    sas = redact_url("https://a.blob.example/c/i.raw?sv=2022&sp=r&sig=S3CRET%3D")
    assert "S3CRET" not in sas and "sv=2022" in sas
    assert (
        redact_url("https://h/k?access_token=t1&v=2") == f"https://h/k?access_token={REDACTED}&v=2"
    )
    assert redact_url("node/vmlinuz") == "node/vmlinuz"
    spec = redact_spec({"kernel": "n/k", "kernel_args": {"console": "ttyS0", "api_key": "k1"}})
    assert spec["kernel_args"] == {"console": "ttyS0", "api_key": REDACTED}


async def test_image_credentials_are_for_admins_only(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _store = api
    body = {"name": "signed", "kind": "disk", "url": SIGNED, "sha256": SHA, "format": "raw"}
    r = await client.post("/api/v1/images", json=body, headers=tokens.header("technician"))
    assert r.status == 201, await r.text()
    image_id = (await r.json())["id"]
    assert "hunter2" not in await r.text()  # not even to the technician who added it
    for role in ("technician", "orchestrator", "orchestrator_other"):
        for url in ("/api/v1/images", f"/api/v1/images/{image_id}"):
            r = await client.get(url, headers=tokens.header(role))
            text = await r.text()
            assert r.status == 200, (role, url)
            assert "hunter2" not in text and "deadbeef" not in text and "AKIA123" not in text
            assert REDACTED in text
    r = await client.get(f"/api/v1/images/{image_id}", headers=tokens.header("admin"))
    assert (await r.json())["spec"]["url"] == SIGNED


async def test_scoped_images_are_seen_and_claimed_by_their_tenants_only(api) -> None:  # type: ignore[no-untyped-def]
    from tests.claims.helpers import add_ready

    client, tokens, _store = api
    staff = tokens.header("technician")
    spec = {"kind": "disk", "url": "https://m/n.raw", "sha256": SHA, "format": "raw"}
    r = await client.post(
        "/api/v1/images",
        json={"name": "a-only", **spec, "tenants": [tokens.tenant_a]},
        headers=staff,
    )
    assert r.status == 201 and (await r.json())["tenants"] == [tokens.tenant_a]
    private = (await r.json())["id"]
    r = await client.post("/api/v1/images", json={"name": "public", **spec}, headers=staff)
    assert r.status == 201 and (await r.json())["tenants"] == []
    r = await client.post(
        "/api/v1/images", json={"name": "nobody", **spec, "tenants": ["no-such"]}, headers=staff
    )
    assert r.status == 422 and "no-such" in (await r.json())["detail"]

    async def names(role: str) -> list[str]:
        r = await client.get("/api/v1/images", headers=tokens.header(role))
        return [i["name"] for i in (await r.json())["items"]]

    assert await names("orchestrator") == ["a-only", "public"]
    assert await names("orchestrator_other") == ["public"]
    assert await names("technician") == ["a-only", "public"]
    r = await client.get(f"/api/v1/images/{private}", headers=tokens.header("orchestrator_other"))
    assert r.status == 404

    add_ready(_store, 1, labels={"pool": "scope"})
    claim = {"count": 1, "selector": {"labels": {"pool": "scope"}}, "image_id": private}
    r = await client.post(
        "/api/v1/claims",
        json={**claim, "tenant_id": tokens.tenant_b},
        headers=tokens.header("orchestrator_other"),
    )
    assert r.status == 422 and "no image" in (await r.json())["detail"]
    r = await client.post(
        "/api/v1/claims",
        json={**claim, "tenant_id": tokens.tenant_a},
        headers=tokens.header("orchestrator"),
    )
    assert r.status == 201, await r.text()
