"""Elastic pools through the API and the spool handler, on both backends: CRUD and scoping,
resume -> one claim per node name (a retried request claims nothing more), a pool of 3 never
claims a 4th, suspend -> the claim released, a resumed-again name gets a fresh claim, no
machine -> the node is named down with a reason and an event."""

from __future__ import annotations

from sqlmodel import col, select

from api.app import CTX_KEY
from api.workflows import elastic_handler
from metald.store.models import Claim, Event
from metald.tenants import elastic
from tests.api_helpers import drain_steps, use_services
from tests.claims.fakes import FakeBmc
from tests.claims.helpers import DISK_SPEC, add_ready


def _elastic_claims(store, live: bool = True) -> dict[str, str]:  # type: ignore[no-untyped-def]
    with store.session() as s:
        rows = s.exec(select(Claim).where(col(Claim.idempotency_key).startswith("elastic:"))).all()
        return {
            c.idempotency_key.split(":")[2]: c.state  # type: ignore[union-attr]
            for c in rows
            if (c.state != "released") == live and c.idempotency_key.count(":") == 2  # type: ignore[union-attr]
        }


async def test_pool_crud_resume_suspend(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    ctx = client.server.app[CTX_KEY]
    use_services(ctx, bmc=FakeBmc(power_state="off"))
    r = await client.post(
        "/api/v1/images",
        json={"name": "node", "kind": "disk", **DISK_SPEC},
        headers=tokens.header("admin"),
    )
    image_id = (await r.json())["id"]
    add_ready(store, 4, labels={"pool": "elastic"})
    base = f"/api/v1/tenants/{tokens.tenant_a}/elastic-pools"
    body = {
        "name": "gpu",
        "prefix": "e",
        "max_nodes": 3,
        "selector": {"labels": {"pool": "elastic"}},
        "image_id": image_id,
    }
    r = await client.post(base, json=body, headers=tokens.header("orchestrator"))
    assert r.status == 201, await r.text()
    pool = await r.json()
    assert pool["hostlist"] == "e[1-3]" and pool["nodes"] == {}
    # Another tenant's orchestrator sees nothing, creates nothing.
    r = await client.get(base, headers=tokens.header("orchestrator_other"))
    assert r.status == 404
    r = await client.post(
        base, json={**body, "name": "x"}, headers=tokens.header("orchestrator_other")
    )
    assert r.status == 404
    # Same prefix twice: refused.
    r = await client.post(
        base, json={**body, "name": "other"}, headers=tokens.header("orchestrator")
    )
    assert r.status == 409

    handle = elastic_handler(ctx)
    assert await handle(tokens.tenant_a, "resume", ["e1", "e2"]) == {}
    assert _elastic_claims(store) == {"e1": "allocated", "e2": "allocated"}
    # slurmctld (or a restarted metald) asks again: nothing more is claimed.
    assert await handle(tokens.tenant_a, "resume", ["e1", "e2"]) == {}
    assert len(_elastic_claims(store)) == 2
    # max 3: e4 is no node of the pool; e3 takes the third machine.
    down = await handle(tokens.tenant_a, "resume", ["e3", "e4"])
    assert down == {"e4": elastic.REASON_NOT_POOL}
    assert set(_elastic_claims(store)) == {"e1", "e2", "e3"}

    assert await handle(tokens.tenant_a, "suspend", ["e1"]) == {}
    assert set(_elastic_claims(store)) == {"e2", "e3"}
    # The released claim keeps its key until the name is resumed again.
    assert _elastic_claims(store, live=False) == {"e1": "released"}
    r = await client.get(f"{base}/{pool['id']}", headers=tokens.header("orchestrator"))
    assert set((await r.json())["nodes"]) == {"e2", "e3"}
    r = await client.delete(f"{base}/{pool['id']}", headers=tokens.header("orchestrator"))
    assert r.status == 409

    # e1 back: a fresh claim. With no machine matching, a name waits down with a reason and
    # an event.
    await drain_steps(client)
    assert await handle(tokens.tenant_a, "resume", ["e1"]) == {}
    assert set(_elastic_claims(store)) == {"e1", "e2", "e3"}
    assert _elastic_claims(store, live=False) == {}
    assert await handle(tokens.tenant_a, "suspend", ["e3"]) == {}
    r = await client.patch(
        f"{base}/{pool['id']}",
        json={"selector": {"labels": {"pool": "none-such"}}},
        headers=tokens.header("orchestrator"),
    )
    assert r.status == 200, await r.text()
    assert await handle(tokens.tenant_a, "resume", ["e3"]) == {"e3": elastic.REASON_NO_MACHINE}
    with store.session() as s:
        ev = s.exec(select(Event).where(Event.kind == "elastic.no-machine")).all()
        assert len(ev) == 1 and "e3" in (ev[0].reason or "")
    await drain_steps(client)
