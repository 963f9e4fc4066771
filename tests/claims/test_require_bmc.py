"""enroll.require_bmc: a host that enrolls itself with an invented MAC and inventory is not
handed to a tenant until a BMC vouches for it (linked) or a technician approves it."""

from __future__ import annotations

import uuid

from sqlmodel import select

from api.app import CTX_KEY
from metald.store.models import Bmc, Event, Machine
from tests.claims.helpers import add_image, add_ready
from tests.test_enrollment import enrolled_via_hooks, payload

SELECT_INVENTED = {"gpu_model": "NVIDIA H100 80GB HBM3", "labels": {"pool": "impostor"}}


async def _self_enroll(client, store) -> str:  # type: ignore[no-untyped-def]
    """The discovery flow an attacker on the provisioning network can run by hand: ask for a
    script for a made-up MAC, then post a made-up inventory with the token it carries."""
    _hooks, target = await enrolled_via_hooks(store)
    agent = {"Authorization": f"Bearer {target.kernel_args['metald.token']}"}
    body = payload(target.machine_id, boot_id=str(uuid.uuid4()))
    r = await client.post("/api/v1/agent/inventory", json=body, headers=agent)
    assert r.status == 200 and (await r.json())["state"] == "ready", await r.text()
    with store.session() as s:
        m = s.get(Machine, target.machine_id)
        assert m is not None
        m.labels = {"pool": "impostor"}
        s.add(m)
        s.commit()
    return target.machine_id


def _register_a_bmc_elsewhere(store) -> None:  # type: ignore[no-untyped-def]
    """Some other (real) machine has a BMC: the fleet uses BMCs, so require_bmc is on."""
    (other,) = add_ready(store, 1, prefix="real", labels={"pool": "real"})
    with store.session() as s:
        s.add(
            Bmc(
                machine_id=other,
                address="10.0.0.9",
                username="u",
                password_enc=b"x",
                protocol="ipmi",
            )
        )
        s.commit()


async def _claim(client, tokens, image_id: str):  # type: ignore[no-untyped-def]
    return await client.post(
        "/api/v1/claims",
        json={
            "tenant_id": tokens.tenant_a,
            "count": 1,
            "selector": SELECT_INVENTED,
            "image_id": image_id,
        },
        headers=tokens.header("orchestrator"),
    )


async def test_a_self_enrolled_impostor_is_not_allocated(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    mid = await _self_enroll(client, store)
    _register_a_bmc_elsewhere(store)
    image_id = add_image(store)

    r = await _claim(client, tokens, image_id)
    assert r.status == 422, await r.text()
    body = await r.json()
    assert (body["matched"], body["available"]) == (1, 0)
    assert "linked to a BMC or approved by a technician" in body["detail"]
    with store.session() as s:
        assert s.get(Machine, mid).tenant_id is None  # type: ignore[union-attr]

    # An orchestrator cannot vouch for it; a technician can, with a reason, and it is recorded.
    url = f"/api/v1/machines/{mid}/approve"
    r = await client.post(url, json={"reason": "x"}, headers=tokens.header("orchestrator"))
    assert r.status == 403
    r = await client.post(url, json={}, headers=tokens.header("technician"))
    assert r.status == 422
    r = await client.post(
        url, json={"reason": "asset tag checked in rack"}, headers=tokens.header("technician")
    )
    assert r.status == 200, await r.text()
    out = await r.json()
    assert out["approved_by"].startswith("technician:") and out["bmc_linked"] is False
    with store.session() as s:
        (ev,) = s.exec(select(Event).where(Event.kind == "machine.approved")).all()
        assert ev.machine_id == mid and ev.data["reason"] == "asset tag checked in rack"

    r = await _claim(client, tokens, image_id)
    assert r.status == 201, await r.text()
    assert [m["id"] for m in (await r.json())["machines"]] == [mid]


async def test_bmc_linked_machines_are_claimable_and_the_setting_wins(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    ctx = client.server.app[CTX_KEY]
    mid = await _self_enroll(client, store)
    image_id = add_image(store)
    # No BMC in the fleet: unset means off, so a BMC-less fleet keeps working as before...
    ctx.cfg.enroll.require_bmc = True  # ...unless the operator turns it on.
    r = await _claim(client, tokens, image_id)
    assert r.status == 422
    with store.session() as s:
        s.add(
            Bmc(
                machine_id=mid, address="10.0.0.8", username="u", password_enc=b"x", protocol="ipmi"
            )
        )
        s.commit()
    r = await _claim(client, tokens, image_id)
    assert r.status == 201, await r.text()


async def test_require_bmc_false_allows_unvouched_machines(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    ctx = client.server.app[CTX_KEY]
    await _self_enroll(client, store)
    _register_a_bmc_elsewhere(store)
    ctx.cfg.enroll.require_bmc = False
    r = await _claim(client, tokens, add_image(store))
    assert r.status == 201, await r.text()
