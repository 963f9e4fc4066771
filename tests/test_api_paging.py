"""Every list endpoint pages the same way (limit, an opaque cursor followed through the
``next`` link, offset kept) and sorts by a listed field; unknown query parameters are refused
on every operation, not only on lists."""

from __future__ import annotations

import pytest

from api.app import ROUTERS, all_specs
from api.paging import PageQuery

LISTS = {
    "/api/v1/machines": "name",
    "/api/v1/tenants": "name",
    "/api/v1/tokens": "name",
    "/api/v1/images": "name",
    "/api/v1/claims": "created_at",
}


async def _walk(client, url: str, headers) -> list[str]:  # type: ignore[no-untyped-def]
    ids: list[str] = []
    while url:
        r = await client.get(url, headers=headers)
        assert r.status == 200, await r.text()
        body = await r.json()
        ids += [i["id"] for i in body["items"]]
        assert len(ids) <= body["total"]
        url = body["next"]
    return ids


@pytest.mark.parametrize("path", sorted(LISTS))
async def test_every_list_pages_by_cursor_to_the_end(api, path: str) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    admin = tokens.header("admin")
    for i in range(3):  # at least three of everything that can be made without hardware
        if path == "/api/v1/tenants":
            await client.post(path, json={"name": f"pg{i}"}, headers=admin)
        elif path == "/api/v1/tokens":
            await client.post(path, json={"name": f"pg{i}", "role": "technician"}, headers=admin)
        elif path == "/api/v1/images":
            body = {"name": f"pg{i}", "kind": "stateless", "kernel": "k", "rootfs": "r"}
            await client.post(path, json=body, headers=admin)
    everything = await (await client.get(f"{path}?limit=1000", headers=admin)).json()
    ids = await _walk(client, f"{path}?limit=1", admin)
    assert ids == [i["id"] for i in everything["items"]]
    assert len(set(ids)) == len(ids) == everything["total"]


async def test_sort_ascending_and_descending(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    admin = tokens.header("admin")
    up = await (await client.get("/api/v1/machines?sort=name", headers=admin)).json()
    down = await (await client.get("/api/v1/machines?sort=-name", headers=admin)).json()
    names = [m["name"] for m in up["items"]]
    assert names == sorted(names) and [m["name"] for m in down["items"]] == names[::-1]
    # The next link keeps the sort (and the filters) of the first page.
    first = await (await client.get("/api/v1/machines?sort=-name&limit=1", headers=admin)).json()
    assert "sort=-name" in first["next"] and "limit=1" in first["next"]
    r = await client.get("/api/v1/machines?sort=password", headers=admin)
    assert r.status == 422 and "sort by one of" in (await r.json())["detail"]


async def test_offset_still_works_and_bad_cursors_are_422(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    admin = tokens.header("admin")
    all_ids = [
        m["id"]
        for m in (await (await client.get("/api/v1/machines", headers=admin)).json())["items"]
    ]
    r = await client.get("/api/v1/machines?offset=1&limit=1", headers=admin)
    assert [m["id"] for m in (await r.json())["items"]] == all_ids[1:2]
    for bad in ("nope", "bzE6LTE", "%00"):
        r = await client.get(f"/api/v1/machines?cursor={bad}", headers=admin)
        assert r.status == 422, bad
    first = await (await client.get("/api/v1/machines?limit=1", headers=admin)).json()
    r = await client.get(first["next"] + "&offset=2", headers=admin)
    assert r.status == 422


def test_every_list_operation_pages() -> None:
    lists = [
        s
        for s in all_specs(ROUTERS)
        if s.method == "GET" and s.response and "items" in s.response.model_fields
    ]
    paged = {s.openapi_path for s in lists if s.query and issubclass(s.query, PageQuery)}
    assert set(LISTS) <= paged


async def test_unknown_query_parameters_are_refused_everywhere(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    admin = tokens.header("admin")
    for url in (
        f"/api/v1/machines/{tokens.machine_a}?verbose=1",
        "/api/v1/whoami?x=1",
        "/api/v1/tenants?nmae=acme",
    ):
        r = await client.get(url, headers=admin)
        assert r.status == 422, url
        detail = (await r.json())["detail"]
        assert "verbose" in detail or "'x'" in detail or "nmae" in detail
