"""metald.client against a real metald served on loopback: the sync client (metalctl's) and
the async one make the calls an orchestrator makes, page through lists, send If-Match, and
raise ApiError/PreconditionFailed with the problem document."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from metald.client import ApiError, PreconditionFailed, claim_settled
from metald.client.aio import AsyncClient
from metald.client.sync import Client
from tests.api_helpers import LoopbackApi


@pytest.fixture
def live(db_url: str, tmp_path: Path) -> Iterator[LoopbackApi]:
    with LoopbackApi(db_url, tmp_path) as api:
        yield api


def test_sync_client_pages_renames_with_if_match_and_reports_problems(live: LoopbackApi) -> None:
    assert live.tokens is not None
    c = Client(live.base, live.tokens.technician)
    # Lists follow their next links to the end, one item per page.
    ids = [m["id"] for m in c.iterate("/api/v1/machines", [("limit", "1")])]
    assert len(ids) == 3 and len(set(ids)) == 3
    m = c.machine("node2")
    tag = c.etag
    assert tag == f'"{m["version"]}"'
    renamed = c.rename_machine("node2", "r01-u01", if_match=tag)
    assert renamed["name"] == "r01-u01"
    with pytest.raises(PreconditionFailed):
        c.machine_action("r01-u01", "maintenance-on", if_match=tag)  # tag is stale now
    with pytest.raises(ApiError) as e:
        c.machine("no-such-machine")
    assert e.value.status == 404 and "no machine" in e.value.detail
    with pytest.raises(ApiError) as e:
        Client(live.base, "mtd_wrong").machine("node2")
    assert e.value.status == 401


async def test_async_client_same_calls(live: LoopbackApi) -> None:
    assert live.tokens is not None
    async with AsyncClient(live.base, live.tokens.technician) as c:
        names = [m["name"] async for m in c.machines(limit="1", sort="name")]
        assert names == ["node0", "node1", "node2"]
        m = await c.machine("node2")
        with pytest.raises(PreconditionFailed):
            await c.machine_action("node2", "maintenance-on", if_match='"999"')
        out = await c.machine_action("node2", "maintenance-on", if_match=c.etag)
        assert out["state"] == "maintenance" and out["version"] > m["version"]


def test_claim_settled_rule() -> None:
    assert claim_settled({"state": "allocated", "machines": [{"state": "active"}]})
    assert not claim_settled({"state": "allocated", "machines": [{"state": "provisioning"}]})
    assert claim_settled({"state": "released", "machines": [{"state": "wiping"}]})
