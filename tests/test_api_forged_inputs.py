"""Forged inputs never reach SQL as a driver error (a 500), on both backends: keyset cursors
whose values do not fit their sort columns (``api.paging``), and NUL in the web console's
inputs (path ids, filters, search, cursor), checked by the API's own input path
(``api.routing.check_inputs``). docs/security.md, "Forged inputs"."""

from __future__ import annotations

import base64
import json
import re
from typing import Any
from urllib.parse import quote

import pytest

from api.paging import PageQuery, encode_keyset, page_items
from metald import machines
from metald.errors import Unprocessable

JSON = {"Accept": "application/json"}


def _keyset(order: list[str], raw_values: str) -> str:
    """A keyset cursor with ``raw_values`` as its JSON value list, verbatim (NaN included)."""
    raw = 'k1:{"o": ' + json.dumps(order) + ', "v": ' + raw_values + "}"
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _ref(order: list[str], row_id: str) -> str:
    raw = "k1:" + json.dumps({"o": order, "r": row_id})
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


FORGED = {
    # Beyond 64 bits: SQLite's driver overflows, PostgreSQL's too.
    "int beyond 64 bits": ("gpu_count", _keyset(["gpu_count", "id"], f'[{1 << 70}, "x"]')),
    "int beyond 64 bits, negative": (
        "-gpu_count",
        _keyset(["-gpu_count", "id"], f'[{-(1 << 64)}, "x"]'),
    ),
    # Wrong types: PostgreSQL refuses to compare them (SQLite compares anything).
    "text for an integer": ("gpu_count", _keyset(["gpu_count", "id"], '["eight", "x"]')),
    "bool for an integer": ("gpu_count", _keyset(["gpu_count", "id"], '[true, "x"]')),
    "NaN for an integer": ("gpu_count", _keyset(["gpu_count", "id"], '[NaN, "x"]')),
    "integer for text": ("name", _keyset(["name", "id"], '[5, "x"]')),
    "integer for an id": ("name", _keyset(["name", "id"], '["node0", 7]')),
    "integer for a timestamp": ("created_at", _keyset(["created_at", "id"], '[5, "x"]')),
    "text for a timestamp": ("created_at", _keyset(["created_at", "id"], '["yesterday", "x"]')),
    # NUL: PostgreSQL text cannot hold it.
    "NUL in text": ("name", _keyset(["name", "id"], '["node\\u0000", "x"]')),
    "NUL in the id": ("name", _keyset(["name", "id"], '["node0", "x\\u0000"]')),
    "NUL in a row reference": ("name", _ref(["name", "id"], "x\x00")),
}


@pytest.mark.parametrize("case", sorted(FORGED))
async def test_forged_cursor_values_are_a_422(api, case: str) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    sort, cursor = FORGED[case]
    r = await client.get(
        "/api/v1/machines",
        params={"sort": sort, "cursor": cursor, "limit": "1"},
        headers=tokens.header("admin"),
    )
    assert r.status == 422, await r.text()
    assert r.content_type == "application/problem+json"
    assert "cursor" in (await r.json())["detail"]


async def test_issued_cursors_still_walk_every_sort(api) -> None:  # type: ignore[no-untyped-def]
    """The check refuses forgeries only: every sort's real cursors walk the whole list."""
    client, tokens, _ = api
    for sort in ("name", "-gpu_count", "created_at", "rack", "state"):
        seen: list[str] = []
        url: str | None = f"/api/v1/machines?sort={sort}&limit=1"
        while url is not None:
            r = await client.get(url, headers=tokens.header("admin"))
            assert r.status == 200, (sort, await r.text())
            page = await r.json()
            seen += [m["id"] for m in page["items"]]
            url = page.get("next")
        assert len(seen) == 3 == len(set(seen)), sort


def test_forged_cursor_on_a_list_held_in_memory_is_a_422() -> None:
    """``page_items`` compares in Python: a value of another type is a 422, not a TypeError."""

    class Q(PageQuery):
        SORTABLE = ("name",)

    items = [{"id": "a", "name": "x"}, {"id": "b", "name": "y"}]
    q = Q.model_validate({"sort": "name", "cursor": encode_keyset(["name", "id"], [5, "a"])})
    with pytest.raises(Unprocessable, match="cursor"):
        page_items(items, q, ["name", "id"], 10, lambda i, f: i[f])


# --- NUL in the web console's inputs: the API's answer, never a 500 ---


async def _console(client: Any, secret: str) -> None:
    r = await client.post(
        "/ui/login", data={"token": secret, "next": "/ui/"}, allow_redirects=False
    )
    assert r.status == 303, await r.text()


NUL = "%00"
CONSOLE_QUERIES = [
    f"/ui/?q=node{NUL}",
    f"/ui/?state=ready{NUL}",
    f"/ui/?gpu_model=H{NUL}",
    f"/ui/?rack=r{NUL}1",
    f"/ui/?tenant=t{NUL}",
    f"/ui/?label=pool{NUL}=x",
    f"/ui/?q{NUL}=x",
    f"/ui/fleet/rows?id=m{NUL}",
    f"/ui/fleet/rows?add=m{NUL}",
    f"/ui/fleet/rows?id=x&q=n{NUL}",
    f"/ui/events?machine_id=m{NUL}",
    f"/ui/events?kind=machine.{NUL}",
    f"/ui/events/stream?kind=k{NUL}",
]
CONSOLE_PATHS = [
    f"/ui/machines/m{NUL}",
    f"/ui/machines/m{NUL}/sensors",
    f"/ui/machines/m{NUL}/bmc-log",
    f"/ui/claims/c{NUL}",
]


@pytest.mark.parametrize("url", CONSOLE_QUERIES)
async def test_nul_in_a_console_query_is_a_422(api, url: str) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    await _console(client, tokens.admin)
    r = await client.get(url, headers=JSON)
    assert r.status == 422, await r.text()
    assert r.content_type == "application/problem+json"
    assert "NUL" in (await r.json())["detail"]


@pytest.mark.parametrize("url", CONSOLE_PATHS)
async def test_nul_in_a_console_path_id_is_a_404(api, url: str) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    await _console(client, tokens.admin)
    r = await client.get(url, headers=JSON)
    assert r.status == 404, await r.text()
    assert "NUL" in (await r.json())["detail"]


async def test_console_and_api_answer_nul_alike(api) -> None:  # type: ignore[no-untyped-def]
    """One input path: the API's events filter and the console's events page refuse the same
    input with the same status and sentence."""
    client, tokens, _ = api
    await _console(client, tokens.admin)
    via_api = await client.get(
        f"/api/v1/events?machine_id=m{NUL}", headers={**JSON, **tokens.header("admin")}
    )
    via_console = await client.get(f"/ui/events?machine_id=m{NUL}", headers=JSON)
    assert via_api.status == via_console.status == 422
    assert (await via_api.json())["detail"] == (await via_console.json())["detail"]


async def test_console_nul_in_the_fleet_cursor_is_not_a_cursor(api) -> None:  # type: ignore[no-untyped-def]
    """The fleet table's own cursor (``after``) with NUL inside its encoding: not one the page
    issued, so the first page (never a 500)."""
    client, tokens, _ = api
    await _console(client, tokens.admin)
    forged = base64.urlsafe_b64encode(json.dumps(["node\x00", "x\x00"]).encode()).decode()
    r = await client.get(f"/ui/?after={quote(forged)}", headers=JSON)
    assert r.status == 200, await r.text()
    assert "node0" in await r.text()


async def test_nul_in_a_bulk_form_is_refused_per_machine_and_nothing_is_written(api) -> None:  # type: ignore[no-untyped-def]
    """The bulk form's ids and reason go through the API's own checks (path ids, body text):
    each machine's refusal is listed, nothing is written, never a 500."""
    client, tokens, store = api
    await _console(client, tokens.admin)
    page = await (await client.get("/ui/")).text()
    csrf = re.search(r'name="csrf" value="([^"]+)"', page)
    assert csrf is not None
    form = {
        "csrf": csrf.group(1),
        "action": "maintenance-on",
        "confirm": "yes",
        "reason": "racked\x00",
        "id": tokens.machine_free,
    }
    r = await client.post("/ui/machines/bulk", data=form, headers=JSON)
    assert r.status == 207, await r.text()
    assert "NUL" in await r.text()
    r = await client.post(
        "/ui/machines/bulk", data={**form, "reason": "racked", "id": "m\x00"}, headers=JSON
    )
    assert r.status == 207, await r.text()
    assert "NUL" in await r.text()
    with store.session() as s:
        assert machines.get_machine(s, tokens.machine_free).state == "ready"
