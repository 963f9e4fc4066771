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


def _add_machines(store, names: list[str]) -> None:  # type: ignore[no-untyped-def]
    from metald.store.models import Machine

    with store.session() as s:
        for n in names:
            s.add(Machine(name=n, state="discovered", labels={}))
        s.commit()


@pytest.mark.parametrize("sort", [None, "name", "-name", "rack", "-created_at"])
async def test_a_page_walk_under_inserts_never_repeats_or_skips(api, sort) -> None:  # type: ignore[no-untyped-def]
    """Rows inserted while a client walks the pages (newest first by default, so in front of
    the walk; names in the middle of a name sort; NULL racks) do not shift it: every row that
    existed when the walk began comes exactly once. An offset walk repeats rows here."""
    client, tokens, store = api
    admin = tokens.header("admin")
    _add_machines(store, [f"m-{i:02d}" for i in range(12)])
    before = {
        m["id"]
        for m in (await (await client.get("/api/v1/machines?limit=1000", headers=admin)).json())[
            "items"
        ]
    }
    url: str | None = "/api/v1/machines?limit=4" + (f"&sort={sort}" if sort else "")
    seen: list[str] = []
    batch = 0
    while url:
        r = await client.get(url, headers=admin)
        assert r.status == 200, await r.text()
        body = await r.json()
        seen += [m["id"] for m in body["items"]]
        url = body["next"]
        batch += 1  # between pages: new machines in front of, inside and behind the walk
        _add_machines(store, [f"a-new-{batch}", f"m-{batch:02d}x", f"z-new-{batch}"])
    assert len(seen) == len(set(seen)), "a row came twice"
    assert before <= set(seen), f"rows skipped: {before - set(seen)}"


async def test_a_cursor_is_bound_to_its_sort(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    admin = tokens.header("admin")
    first = await (await client.get("/api/v1/machines?sort=name&limit=1", headers=admin)).json()
    cursor = first["next"].split("cursor=")[1]
    r = await client.get(f"/api/v1/machines?sort=-name&cursor={cursor}", headers=admin)
    assert r.status == 422 and "sorted another way" in (await r.json())["detail"]
    # A forged keyset (a value that is not a plain JSON scalar) is refused, not evaluated.
    import base64

    forged = base64.urlsafe_b64encode(b'k1:{"o":["name","id"],"v":[{"x":1},"a"]}').decode()
    r = await client.get(f"/api/v1/machines?sort=name&cursor={forged}", headers=admin)
    assert r.status == 422


async def test_bmcs_and_instances_page_like_the_others(api) -> None:  # type: ignore[no-untyped-def]
    """BMCs (a real BmcService over the store) and instances page by the same cursor."""
    from metald.bmc.service import BmcService
    from metald.config import load_config
    from metald.secrets import SecretBox
    from metald.store.models import Bmc

    client, tokens, store = api
    admin = tokens.header("admin")
    with store.session() as s:
        for i in range(5):
            s.add(Bmc(address=f"10.0.7.{i}", protocol="ipmi", username="admin", password_enc=b"x"))
        s.commit()
    from api.app import CTX_KEY
    from tests.api_helpers import use_services

    ctx = client.server.app[CTX_KEY]
    cfg = load_config(None, environ={"METALD_STATE_DIR": str(ctx.cfg.state_dir)})
    use_services(
        ctx, bmc=BmcService(store, SecretBox.from_file(ctx.cfg.secrets_key_path), cfg.bmc, "t")
    )
    ids = await _walk(client, "/api/v1/bmcs?limit=2", admin)
    everything = await (await client.get("/api/v1/bmcs?limit=1000", headers=admin)).json()
    assert ids == [b["id"] for b in everything["items"]] and len(ids) == everything["total"] == 5
    assert [b["address"] for b in everything["items"]] == sorted(f"10.0.7.{i}" for i in range(5))
    r = await client.get("/api/v1/bmcs?sort=-address&limit=1000", headers=admin)
    assert [b["address"] for b in (await r.json())["items"]][0] == "10.0.7.4"
    r = await client.get("/api/v1/instances?limit=1", headers=admin)
    body = await r.json()
    assert r.status == 200 and {"total", "limit", "next"} <= set(body)
    r = await client.get("/api/v1/bmcs?nope=1", headers=admin)
    assert r.status == 422


async def test_a_key_too_long_for_a_cursor_pages_by_reference(api) -> None:  # type: ignore[no-untyped-def]
    """A sort value longer than a cursor may carry (a GPU model string from an inventory)
    still pages: the cursor names the row, whose key is read back for the next page."""
    from api.paging import MAX_CURSOR
    from metald.store.models import Machine

    client, tokens, store = api
    admin = tokens.header("admin")
    with store.session() as s:
        for i in range(4):
            s.add(Machine(name=f"long{i}", state="ready", labels={}, gpu_model=f"{i}" + "G" * 600))
        s.commit()
    url = "/api/v1/machines?sort=gpu_model&limit=1"
    first = await (await client.get(url, headers=admin)).json()
    assert len(first["next"].split("cursor=")[1]) <= MAX_CURSOR
    ids = await _walk(client, url, admin)
    everything = await (await client.get(url.replace("limit=1", "limit=100"), headers=admin)).json()
    assert ids == [m["id"] for m in everything["items"]] and len(ids) == len(set(ids))


async def test_a_forged_row_reference_outside_the_scope_is_refused(api) -> None:  # type: ignore[no-untyped-def]
    """A reference cursor is resolved through the list's own filters: an orchestrator cannot
    learn where another tenant's machine sorts by naming its id in a forged cursor."""
    import base64

    client, tokens, _ = api
    orch = tokens.header("orchestrator")  # tenant A: sees machine_a, not machine_b

    def ref(machine_id: str) -> str:
        raw = f'k1:{{"o":["name","id"],"r":"{machine_id}"}}'.encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    r = await client.get(f"/api/v1/machines?sort=name&cursor={ref(tokens.machine_b)}", headers=orch)
    assert r.status == 422 and "gone" in (await r.json())["detail"]
    r = await client.get(f"/api/v1/machines?sort=name&cursor={ref(tokens.machine_a)}", headers=orch)
    assert r.status == 200 and (await r.json())["items"] == []  # nothing after its only one


async def test_events_page_by_next_like_the_other_lists(api) -> None:  # type: ignore[no-untyped-def]
    """Events keep their commit-order ``after`` cursor, and a full page also links the next."""
    client, tokens, _ = api
    tech = tokens.header("technician")
    for action in ("maintenance-on", "maintenance-off", "maintenance-on"):
        r = await client.post(
            f"/api/v1/machines/{tokens.machine_free}/actions",
            json={"action": action},
            headers=tech,
        )
        assert r.status == 200, await r.text()
    everything = await (await client.get("/api/v1/events?limit=1000", headers=tech)).json()
    assert everything["next"] is None and len(everything["items"]) >= 3
    ids, url = [], "/api/v1/events?limit=2&kind=machine.state"
    while url:
        body = await (await client.get(url, headers=tech)).json()
        ids += [e["id"] for e in body["items"]]
        assert body["next"] is None or "kind=machine.state" in body["next"]
        url = body["next"]
    assert ids == [e["id"] for e in everything["items"] if e["kind"] == "machine.state"]
    newest = await (await client.get("/api/v1/events?limit=1&sort=-id", headers=tech)).json()
    assert newest["next"] is None
