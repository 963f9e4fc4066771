"""The remediation workflow on both backends, against a recording scheduler: every step of
the table carried out once, rate limits serialised with the refusal as an event, and a crash
anywhere (between steps, inside the replacement's transaction, two instances at once) never
doing a step twice or claiming two replacements."""

from __future__ import annotations

import asyncio

import pytest
from sqlmodel import select

from metald.health.remediation import Step
from metald.lifecycle import State
from metald.store.models import Machine
from tests.healthwatch.helpers import (
    FakeScheduler,
    active_claim,
    bmc_fault,
    claim_members,
    events,
    health_cfg,
    rem_rows,
    workflow,
)


async def test_a_fatal_fault_is_drained_removed_replaced_and_repaired(store) -> None:  # type: ignore[no-untyped-def]
    c = active_claim(store, 2, spares=1)
    cfg = health_cfg()
    sched = FakeScheduler()
    bad = c.machines[0]
    assert bmc_fault(store, bad, cfg) == 1
    (row,) = rem_rows(store)
    assert (row.machine_id, row.step, row.severity) == (bad, "waiting", "fatal")
    wf = workflow(store, sched, cfg)
    await wf.run_all()
    (row,) = rem_rows(store)
    assert row.step == Step.DONE and row.open_machine is None
    node = row.node
    assert [c_ for c_ in sched.calls] == [("drain", node), ("remove", node)]
    assert sched.drained[node].startswith("metald: #0042 critical: Memory #0x01 Uncorrectable")
    with store.session() as s:
        # The claim keeps its count: the spare replaced the bad machine and is provisioning.
        assert claim_members(s, c.claim_id) == sorted([c.machines[1], c.spares[0]])
        assert row.replacement_id == c.spares[0]
        assert s.get(Machine, c.spares[0]).state == State.PROVISIONING
        m = s.get(Machine, bad)
        assert (m.state, m.tenant_id, m.claim_id) == (State.BROKEN, None, None)
    steps = [e.kind for e in events(store, "health.remediation.")]
    assert steps == [
        "health.remediation.opened",
        "health.remediation.drain",
        "health.remediation.wait-jobs",
        "health.remediation.remove",
        "health.remediation.replace",
        "health.remediation.repair",
        "health.remediation.done",
    ]
    for e in events(store, "health.remediation."):
        assert e.tenant_id == c.tenant_id and e.data["claim_id"] == c.claim_id and e.reason
    broken = [e for e in events(store, "machine.state") if e.to_state == "broken"]
    assert broken and "Uncorrectable ECC" in broken[0].reason
    assert broken[0].data["faults"][0]["witness"] == "bmc"
    await wf.run_all()  # nothing left: nothing done again
    assert len(sched.calls) == 2


async def test_jobs_may_finish_until_the_bound(store) -> None:  # type: ignore[no-untyped-def]
    c = active_claim(store, 1, spares=1)
    cfg = health_cfg(job_wait_s=3600)
    sched = FakeScheduler()
    bmc_fault(store, c.machines[0], cfg)
    (row,) = rem_rows(store)
    sched.jobs[row.node] = ["17"]
    wf = workflow(store, sched, cfg)
    await wf.run_all()
    (row,) = rem_rows(store)
    assert row.step == Step.WAIT_JOBS and sched.calls == [("drain", row.node)]
    assert row.reason == f"{c.machines[0]} drained; running jobs may finish for up to 3600 s"
    sched.jobs[row.node] = []  # the job ended
    await wf.run_all()
    (row,) = rem_rows(store)
    assert row.step == Step.DONE and ("remove", row.node) in sched.calls


@pytest.mark.parametrize("per_claim", [1, 2])
async def test_five_faults_in_one_claim_only_the_limit_acts(store, per_claim: int) -> None:  # type: ignore[no-untyped-def]
    c = active_claim(store, 5, spares=0)
    cfg = health_cfg(job_wait_s=3600, limits={"per_claim": per_claim, "per_rack": 10})
    sched = FakeScheduler()
    for mid in c.machines:
        bmc_fault(store, mid, cfg)
        sched.jobs[f"gpu{c.machines.index(mid)}-0"] = ["1"]  # jobs keep them in wait-jobs
    wf = workflow(store, sched, cfg)
    await wf.run_all()
    rows = rem_rows(store)
    acting = [r for r in rows if r.step != Step.WAITING]
    waiting = [r for r in rows if r.step == Step.WAITING]
    assert len(acting) == per_claim and len(waiting) == 5 - per_claim
    assert len([x for x in sched.calls if x[0] == "drain"]) == per_claim
    told = events(store, "health.remediation.waiting")
    assert len(told) == 5 - per_claim  # once each, not every round
    assert all(
        f"already has {per_claim} machine(s) in remediation" in e.reason
        and f"the limit is {per_claim}" in e.reason
        for e in told
    )
    await wf.run_all()
    assert len(events(store, "health.remediation.waiting")) == 5 - per_claim


async def test_two_instances_admitting_at_once_stay_under_the_limit(store) -> None:  # type: ignore[no-untyped-def]
    c = active_claim(store, 4, spares=0)
    cfg = health_cfg(job_wait_s=3600, limits={"per_claim": 1})
    sched = FakeScheduler()
    for i, mid in enumerate(c.machines):
        bmc_fault(store, mid, cfg)
        sched.jobs[f"gpu{i}-0"] = ["1"]
    a, b = workflow(store, sched, cfg, "i1"), workflow(store, sched, cfg, "i2")
    ids = [r.id for r in rem_rows(store)]
    await asyncio.gather(*(w.advance(i) for i in ids for w in (a, b)))
    held = [r for r in rem_rows(store) if r.step not in (Step.WAITING, Step.DONE)]
    assert len(held) == 1


class _DiesOnce:
    """A provisioning runner that dies inside the replacement's transaction once."""

    def __init__(self) -> None:
        self.died = False

    def start_provisioning(self, session, machine_ids, *, actor, instance=None):  # type: ignore[no-untyped-def]
        if not self.died:
            self.died = True
            raise RuntimeError("killed mid-transaction")
        from metald.provision.netboot import start_provisioning

        return start_provisioning(session, machine_ids, actor=actor, instance=instance)


async def test_a_crash_inside_the_replacement_claims_nothing_and_resume_claims_one(store) -> None:  # type: ignore[no-untyped-def]
    c = active_claim(store, 1, spares=2)
    cfg = health_cfg()
    sched = FakeScheduler()
    bmc_fault(store, c.machines[0], cfg)
    dying = workflow(store, sched, cfg, "i1", boot=_DiesOnce())
    with pytest.raises(RuntimeError, match="killed"):
        await dying.run_all()
    (row,) = rem_rows(store)
    assert row.step == Step.REPLACE and row.replacement_id is None
    with store.session() as s:  # rolled back whole: no spare was taken
        assert claim_members(s, c.claim_id) == []
        assert all(s.get(Machine, x).state == State.READY for x in c.spares)
    # The survivor (another instance) resumes from the stored step.
    survivor = workflow(store, sched, cfg, "i2")
    await survivor.run_all()
    (row,) = rem_rows(store)
    assert row.step == Step.DONE and row.owner == "i2"
    with store.session() as s:
        members = claim_members(s, c.claim_id)
        assert len(members) == 1 and members == [row.replacement_id]
        ready = s.exec(select(Machine).where(Machine.state == State.READY)).all()
        assert len(ready) == 1  # exactly one spare taken
    assert sched.calls.count(("remove", row.node)) == 1
    assert sched.calls.count(("drain", row.node)) == 1


async def test_two_instances_racing_every_step_claim_one_replacement(store) -> None:  # type: ignore[no-untyped-def]
    c = active_claim(store, 1, spares=3)
    cfg = health_cfg()
    sched = FakeScheduler()
    bmc_fault(store, c.machines[0], cfg)
    a, b = workflow(store, sched, cfg, "i1"), workflow(store, sched, cfg, "i2")
    (rid,) = [r.id for r in rem_rows(store)]
    for _ in range(10):
        await asyncio.gather(a.advance(rid), b.advance(rid), return_exceptions=True)
    (row,) = rem_rows(store)
    assert row.step == Step.DONE
    with store.session() as s:
        assert len(claim_members(s, c.claim_id)) == 1
        assert len(s.exec(select(Machine).where(Machine.state == State.READY)).all()) == 2
    assert len(events(store, "health.remediation.replace")) == 1
    assert len(events(store, "health.remediation.done")) == 1


async def test_no_free_machine_waits_with_a_sentence(store) -> None:  # type: ignore[no-untyped-def]
    c = active_claim(store, 1, spares=0)
    cfg = health_cfg()
    sched = FakeScheduler()
    bmc_fault(store, c.machines[0], cfg)
    wf = workflow(store, sched, cfg)
    await wf.run_all()
    await wf.run_all()
    (row,) = rem_rows(store)
    assert row.step == Step.REPLACE
    (e,) = events(store, "health.remediation.stalled")
    assert "no free machine matches claim" in e.reason and e.data["claim_id"] == c.claim_id


async def test_a_machine_the_tenant_released_meanwhile_gets_no_replacement(store) -> None:  # type: ignore[no-untyped-def]
    from metald.claims.release import release_machine
    from metald.store.models import Claim
    from tests.claims.helpers import DEPLOY

    c = active_claim(store, 2, spares=1)
    cfg = health_cfg(job_wait_s=3600)
    sched = FakeScheduler()
    bmc_fault(store, c.machines[0], cfg)
    (row,) = rem_rows(store)
    sched.jobs[row.node] = ["1"]
    wf = workflow(store, sched, cfg)
    await wf.run_all()
    assert rem_rows(store)[0].step == Step.WAIT_JOBS
    with store.session() as s:  # the tenant scales down by that very machine
        release_machine(s, s.get(Claim, c.claim_id), c.machines[0], "orch", deploy=DEPLOY)
    await wf.run_all()
    (row,) = rem_rows(store)
    assert row.step == Step.DONE and row.replacement_id is None
    assert "left claim" in row.reason
    assert ("remove", row.node) not in sched.calls
    with store.session() as s:
        assert s.get(Machine, c.spares[0]).state == State.READY


async def test_the_rack_limit_holds_too(store) -> None:  # type: ignore[no-untyped-def]
    c = active_claim(store, 3, spares=0, racks=["r1", "r1", "r2"])
    cfg = health_cfg(job_wait_s=3600, limits={"per_claim": 10, "per_rack": 1})
    sched = FakeScheduler()
    for mid in c.machines:
        bmc_fault(store, mid, cfg)
    for i in range(3):
        sched.jobs[f"gpu{i}-0"] = ["1"]
    await workflow(store, sched, cfg).run_all()
    rows = {r.machine_id: r for r in rem_rows(store)}
    with store.session() as s:
        racks = {mid: s.get(Machine, mid).rack for mid in c.machines}
    acting = sorted(racks[m] for m, r in rows.items() if r.step != Step.WAITING)
    assert acting == ["r1", "r2"]
    (told,) = events(store, "health.remediation.waiting")
    assert "rack r1 already has 1 machine(s) in remediation" in told.reason


async def test_the_repair_step_puts_the_machine_in_the_technicians_queue_with_its_evidence(  # type: ignore[no-untyped-def]
    store,
) -> None:
    """The daemon's wiring: the remediation's repair step opens the machine's repair (the
    queue technicians work from, docs/repairs.md) with the BMC's record as evidence, once."""
    from metald.store.models import Repair
    from metald.usecases.repairs import RepairQueue

    c = active_claim(store, 2, spares=1)
    cfg = health_cfg()
    bad = c.machines[0]
    bmc_fault(store, bad, cfg)
    wf = workflow(store, FakeScheduler(), cfg, repair=RepairQueue(instance="i1", actor="metald:i1"))
    await wf.run_all()
    await wf.run_all()  # nothing left: the queue gets the machine once
    (row,) = rem_rows(store)
    assert row.step == Step.DONE
    with store.session() as s:
        (repair,) = s.exec(select(Repair)).all()
        assert (repair.machine_id, repair.status, repair.source) == (bad, "open", "remediation")
        assert repair.remediation_id == row.id
        assert any(
            "Uncorrectable" in f["evidence"] and f["witness"] == "bmc" for f in repair.faults
        )
        assert s.get(Machine, bad).state == State.BROKEN
    assert [e.kind for e in events(store, "repair.opened")] == ["repair.opened"]
