"""A rollout's machine in use, drained through the Day-2 path with its tenant's consent
(issue 27, item 3's third policy): the claim's consent set over the API by the tenant's
orchestrator (an event on the claim's stream), the rollout opening a remediation of cause
``firmware``, the health watch's workflow draining the node in the tenant's scheduler, taking
the machine out of the claim and claiming a replacement (no repair), and the rollout flashing
the machine once it is back in the pool. Without consent it waits for the release.

The tenant's scheduler is the Day-2 tests' recording one (tests/healthwatch/helpers.py; the
real Slurm path is tests/healthwatch/test_slurm_loop.py's); the updates service is a recording
stand-in (the flash itself is tests/firmware/test_rollouts.py's, against lab BMCs)."""

from __future__ import annotations

from typing import Any

from sqlmodel import select

from metald.firmware.rollouts import FirmwareRollouts
from metald.healthwatch.workflow import FirmwareDrain
from metald.lifecycle import State, Trigger
from metald.machines import transition
from metald.store import Store
from metald.store.models import Claim, Event, FirmwareRollout, FirmwareRolloutTarget, Machine
from tests.healthwatch.helpers import (
    FakeScheduler,
    active_claim,
    claim_members,
    health_cfg,
    node_name,
    rem_rows,
    workflow,
)


class Updates:
    """The updates service as a rollout uses it, recording what it was asked."""

    def __init__(self) -> None:
        self.started: list[str] = []

    async def start_update(self, machine_id: str, **_: Any) -> list[dict[str, Any]]:
        self.started.append(machine_id)
        return []

    async def resume(self) -> list[str]:
        return []


def _rollout(store: Store, machine_ids: list[str]) -> str:
    with store.session() as s:
        r = FirmwareRollout(profile="h100-8x", baseline_version=1, batch_size=5,
                            max_unavailable=5, failure_budget=1, in_use="drain",
                            state="running", created_by="test")  # fmt: skip
        s.add(r)
        s.flush()
        for i, mid in enumerate(machine_ids):
            s.add(FirmwareRolloutTarget(rollout_id=r.id, machine_id=mid, seq=i, status="pending"))
        s.commit()
        return r.id


def _status(store: Store, rid: str) -> dict[str, str]:
    with store.session() as s:
        rows = s.exec(
            select(FirmwareRolloutTarget).where(FirmwareRolloutTarget.rollout_id == rid)
        ).all()
        return {t.machine_id: t.status for t in rows}


def _consent(store: Store, claim_id: str, on: bool) -> None:
    with store.session() as s:
        c = s.get(Claim, claim_id)
        assert c is not None
        c.firmware_consent = on
        s.add(c)
        s.commit()


async def test_drained_with_consent_replaced_then_flashed_from_the_pool(store: Store) -> None:
    c = active_claim(store, 1, spares=1)
    [mid] = c.machines
    cfg = health_cfg(job_wait_s=0)
    sched = FakeScheduler()
    node = node_name(store, mid)
    sched.jobs[node] = ["job-1"]
    updates = Updates()
    ro = FirmwareRollouts(store, updates, "i1", drain=FirmwareDrain(cfg))
    rid = _rollout(store, [mid])

    # No consent yet: the machine waits for its release; nothing is drained.
    await ro.step(rid)
    assert _status(store, rid) == {mid: "waiting"} and rem_rows(store) == []

    # The tenant consents: the next step opens its drain.
    _consent(store, c.claim_id, True)
    await ro.step(rid)
    assert _status(store, rid) == {mid: "draining"}
    [row] = rem_rows(store)
    assert (row.machine_id, row.cause, row.step) == (mid, "firmware", "waiting")
    await ro.step(rid)  # drained once: no second remediation
    assert len(rem_rows(store)) == 1 and updates.started == []

    # The Day-2 path: drained in the tenant's scheduler, out of the claim, a spare claimed in
    # its place, no repair (the machine is healthy).
    booted: list[str] = []
    released: list[tuple[list[str], str]] = []
    wf = workflow(store, sched, cfg, network_boot=lambda ids, _a: booted.extend(ids),
                  released=lambda ids, claim, _a: released.append((ids, claim)))  # fmt: skip
    await wf.run_all()
    [row] = rem_rows(store)
    assert row.step == "done" and row.replacement_id == c.spares[0]
    assert sched.calls == [("drain", node), ("remove", node)]
    assert sched.drained[node].startswith("metald: firmware rollout")
    assert booted == [c.spares[0]]  # the replacement's provisioning
    # The drained machine: the release clean-up, then its wipe, as a release does.
    assert released == [([mid], c.claim_id)]
    with store.session() as s:
        m = s.get(Machine, mid)
        assert m is not None and (m.state, m.claim_id, m.tenant_id) == ("releasing", None, None)
        assert claim_members(s, c.claim_id) == [c.spares[0]]
        kinds = [
            e.kind
            for e in s.exec(
                select(Event).where(Event.machine_id == mid).order_by(Event.id)  # type: ignore[arg-type]
            )
        ]
    assert "health.remediation.repair" not in kinds and "health.remediation.done" in kinds
    await ro.step(rid)
    assert _status(store, rid) == {mid: "draining"} and updates.started == []

    # Wiped back to ready: the rollout takes it into maintenance and flashes it.
    with store.session() as s:
        transition(s, mid, Trigger.WIPE, actor="test")
        transition(s, mid, Trigger.WIPED, actor="test")
    await ro.step(rid)
    assert _status(store, rid) == {mid: "updating"} and updates.started == [mid]
    with store.session() as s:
        m = s.get(Machine, mid)
        assert m is not None and m.state == State.MAINTENANCE
        evs = s.exec(
            select(Event).where(Event.kind == "firmware.rollout-machine", Event.machine_id == mid)
        ).all()
    assert [e.data["status"] for e in evs] == ["waiting", "draining"]
    assert evs[1].data["remediation_id"] == row.id


async def test_without_a_day2_path_consent_waits(store: Store) -> None:
    c = active_claim(store, 1, spares=0)
    _consent(store, c.claim_id, True)
    ro = FirmwareRollouts(store, Updates(), "i1")  # no drain wired
    rid = _rollout(store, c.machines)
    await ro.step(rid)
    assert _status(store, rid) == {c.machines[0]: "waiting"} and rem_rows(store) == []


async def test_consent_over_the_api_by_the_tenant_with_an_event(api: Any) -> None:
    """The tenant's orchestrator sets and withdraws its claim's consent (If-Match honoured);
    another tenant's orchestrator sees no such claim; technicians may not consent for a
    tenant; each change is an event on the claim's stream."""
    from api.app import CTX_KEY
    from tests.api_helpers import use_services
    from tests.claims.fakes import FakeBmc
    from tests.claims.helpers import add_ready
    from tests.claims.test_api_claims import KEY, _image

    client, tokens, store = api
    use_services(client.server.app[CTX_KEY], bmc=FakeBmc(power_state="off"))
    image_id = await _image(client, tokens)
    add_ready(store, 1, labels={"pool": "fw"})
    body = {"tenant_id": tokens.tenant_a, "count": 1, "selector": {"labels": {"pool": "fw"}},
            "image_id": image_id, "ssh_authorized_keys": [KEY]}  # fmt: skip
    orch = tokens.header("orchestrator")
    r = await client.post("/api/v1/claims", json=body, headers=orch)
    assert r.status == 201, await r.text()
    claim = await r.json()
    assert claim["firmware_consent"] is False
    path = f"/api/v1/claims/{claim['id']}/firmware-consent"
    r = await client.put(path, json={"consent": True}, headers=tokens.header("orchestrator_other"))
    assert r.status == 404
    r = await client.put(path, json={"consent": True}, headers=tokens.header("technician"))
    assert r.status == 403
    r = await client.put(path, json={"consent": True}, headers={**orch, "If-Match": '"999"'})
    assert r.status in (409, 412), await r.text()
    r = await client.put(path, json={"consent": True}, headers=orch)
    assert r.status == 200, await r.text()
    got = await r.json()
    assert got["firmware_consent"] is True and got["version"] == claim["version"] + 1
    r = await client.put(path, json={"consent": True}, headers=orch)  # unchanged: no event
    assert (await r.json())["version"] == got["version"]
    r = await client.put(path, json={"consent": False}, headers=orch)
    assert (await r.json())["firmware_consent"] is False
    with store.session() as s:
        evs = s.exec(
            select(Event).where(Event.kind == "claim.firmware-consent").order_by(Event.id)  # type: ignore[arg-type]
        ).all()
    assert [(e.data["claim_id"], e.data["consent"], e.tenant_id) for e in evs] == [
        (claim["id"], True, tokens.tenant_a),
        (claim["id"], False, tokens.tenant_a),
    ]
    assert "consents to its machines being drained" in (evs[0].reason or "")
