"""Proof (d) with real BMCs: five OpenIPMI ``ipmi_sim`` BMCs, one per machine of one claim, all
log an uncorrectable-ECC record at once (Add SEL Entry, as the lab's fault injection does), then
flap (the record deasserted and asserted again, several times). One health watch reads the five
SELs through metald's IPMI driver; at most ``[health.limits] per_claim`` machines are acted on
at any moment, and each of the others gets one event saying why it waits (the claim, the
machines in remediation, the limit). As each admitted remediation ends, the next one is let
in, so the claim never has more than the limit out at once, all five end replaced, and a flap
never undrains or double-counts a machine.

The node's word cannot save a machine its BMC condemns: ``tests/health/test_api_report.py``
(``test_a_healthy_report_does_not_save_a_node_its_bmc_condemns``)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import col, select

from metald.bmc.base import BmcEndpoint
from metald.bmc.ipmi import IpmiDriver
from metald.health.remediation import HOLDS_SLOT, Step
from metald.healthwatch.watch import HealthWatch
from metald.lifecycle import State
from metald.store.models import Bmc, Event, HealthFault, Machine
from tests.bmc.peers import IpmiSim, start_ipmi_sim, stop_peer
from tests.healthwatch.helpers import (
    FakeScheduler,
    active_claim,
    claim_members,
    events,
    health_cfg,
    node_name,
    rem_rows,
    workflow,
)
from vmlab import faults as lab_faults

pytestmark = [
    pytest.mark.skipif(
        shutil.which("ipmi_sim") is None or shutil.which("ipmitool") is None,
        reason="needs ipmi_sim and ipmitool (Debian packages openipmi, ipmitool)",
    ),
    # Five BMCs' SEL reads through pyghmi: 64 s on a busy 2-core machine. make test keeps the
    # limit's in-process proof (tests/healthwatch/test_workflow.py).
    pytest.mark.skipif(
        os.environ.get("METALD_LAB_LONG") != "1",
        reason="five ipmi_sim BMCs flapping, > 20 s: METALD_LAB_LONG=1 (make test-long)",
    ),
]

N = 5
PER_CLAIM = 2
_HOLDING = {s.value for s in HOLDS_SLOT}


class ManyReads:
    """The BMC service's event-log reads, one real IPMI driver per machine."""

    def __init__(self, drivers: dict[str, IpmiDriver]) -> None:
        self.drivers = drivers

    async def event_log(self, machine_id: str) -> list[dict[str, Any]]:
        return [
            {"id": e.id, "at": e.at.isoformat() if e.at else None, "severity": e.severity,
             "message": e.message}
            for e in await self.drivers[machine_id].event_log()
        ]  # fmt: skip

    async def sensors(self, machine_id: str) -> list[dict[str, Any]]:
        return []


def _target(sim: IpmiSim) -> lab_faults.BmcTarget:
    return lab_faults.BmcTarget("127.0.0.1", sim.port, sim.username, sim.password)


def _holding_at_most(store: Any) -> int:
    """The most remediations of the claim that held a slot at one time, replayed from the
    step events in the order they were written."""
    with store.session() as s:
        evs = s.exec(
            select(Event)
            .where(col(Event.kind).startswith("health.remediation."))
            .order_by(col(Event.id))
        ).all()
    step: dict[str, str] = {}
    most = 0
    for e in evs:
        rid, st = e.data["remediation_id"], e.data["step"]
        step[rid] = st
        most = max(most, sum(1 for v in step.values() if v in _HOLDING))
    return most


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # the fleet's store
async def test_a_flapping_bmc_on_five_machines_acts_on_at_most_the_limit(
    store, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    c = active_claim(store, N, spares=N)
    cfg = health_cfg(job_wait_s=3600, limits={"per_claim": PER_CLAIM, "per_rack": 100})
    sched = FakeScheduler()
    nodes = {mid: node_name(store, mid) for mid in c.machines}
    for node in nodes.values():
        sched.jobs[node] = ["42"]  # a job on every node keeps the admitted ones in wait-jobs
    started = [start_ipmi_sim(tmp_path / f"bmc{i}") for i in range(N)]
    sims = {mid: sim for mid, (sim, _) in zip(c.machines, started, strict=True)}
    drivers = {
        mid: IpmiDriver(
            BmcEndpoint("127.0.0.1", sim.port, sim.username, sim.password),
            request_timeout_s=5.0,
            resend_s=0.3,
        )  # fmt: skip
        for mid, sim in sims.items()
    }
    try:
        with store.session() as s:
            for mid, sim in sims.items():
                s.add(Bmc(machine_id=mid, address="127.0.0.1", port=sim.port, protocol="ipmi",
                          username="u", password_enc=b"x"))  # fmt: skip
            s.commit()
        wf = workflow(store, sched, cfg, require_bmc=False)  # the spares have no BMC here
        watch = HealthWatch(store, cfg, "i1", remediations=wf, table=cfg.table(),
                            bmc=ManyReads(drivers))  # fmt: skip
        await watch.round(reads=True)  # the first reading sets the five cursors
        assert rem_rows(store) == []

        uecc = lab_faults.memory_uncorrectable_ecc(dimm=1)
        cleared = lab_faults.SelRecord(**{**uecc.__dict__, "assertion": False})

        async def flap(times: int) -> None:
            async def one(sim: IpmiSim) -> None:
                for _ in range(times):
                    await asyncio.to_thread(lab_faults.add_sel, _target(sim), uecc)
                    await asyncio.to_thread(lab_faults.add_sel, _target(sim), cleared)
                await asyncio.to_thread(lab_faults.add_sel, _target(sim), uecc)

            await asyncio.gather(*(one(sim) for sim in sims.values()))

        t0 = time.monotonic()
        await flap(1)  # all five BMCs log the fault at once (and flap once)
        print(f"\nthree SEL records added to each of five BMCs: {time.monotonic() - t0:.1f} s")
        t0 = time.monotonic()
        await watch.round(reads=True)
        print(f"five SELs read, {PER_CLAIM} drained, {N - PER_CLAIM} told to wait: "
              f"{(time.monotonic() - t0) * 1000:.0f} ms")  # fmt: skip
        rows = rem_rows(store)
        assert len(rows) == N and all(r.severity == "fatal" for r in rows)
        acting = [r for r in rows if r.step != Step.WAITING]
        waiting = [r for r in rows if r.step == Step.WAITING]
        assert len(acting) == PER_CLAIM and {r.step for r in acting} == {Step.WAIT_JOBS}
        assert sorted(sched.drained) == sorted(r.node for r in acting)
        told = events(store, "health.remediation.waiting")
        assert sorted(e.machine_id for e in told) == sorted(r.machine_id for r in waiting)
        for e in told:
            assert e.data["claim_id"] == c.claim_id and e.tenant_id == c.tenant_id
            assert f"claim {c.claim_id} already has {PER_CLAIM} machine(s) in remediation" in (
                e.reason or ""
            )
            assert f"the limit is {PER_CLAIM}" in (e.reason or "")
            for r in acting:  # the sentence names the machines holding the slots
                assert r.machine_id in (e.reason or "")

        # The BMCs keep flapping: the faults are counted, not reopened; nothing more is acted
        # on, no undrain (a fatal fault is never cleared by a signal), no new waiting event.
        await flap(1)
        await watch.round(reads=True)
        rows = rem_rows(store)
        assert len([r for r in rows if r.step != Step.WAITING]) == PER_CLAIM
        assert [x for x in sched.calls if x[0] == "undrain"] == []
        assert len([x for x in sched.calls if x[0] == "drain"]) == PER_CLAIM
        assert len(events(store, "health.remediation.waiting")) == N - PER_CLAIM
        with store.session() as s:
            open_faults = s.exec(select(HealthFault).where(col(HealthFault.open_key).is_not(None)))
            per_machine = {f.machine_id: f for f in open_faults}
        assert sorted(per_machine) == sorted(c.machines)  # one open fault per machine
        assert all(f.severity == "fatal" and f.count >= 2 for f in per_machine.values())

        # The jobs end one node at a time: each admitted remediation finishes and lets the
        # next waiting one in, never more than the limit out of the claim at once.
        for _ in range(N * 3):
            active = [r for r in rem_rows(store) if r.step in _HOLDING]
            if not active:
                break
            sched.jobs[active[0].node] = []
            await watch.round(reads=False)
        rows = rem_rows(store)
        assert all(r.step == Step.DONE for r in rows), [(r.step, r.reason) for r in rows]
        assert _holding_at_most(store) == PER_CLAIM
        with store.session() as s:
            members = claim_members(s, c.claim_id)
            assert len(members) == N and not set(members) & set(c.machines)  # all replaced
            for mid in c.machines:
                assert s.get(Machine, mid).state == State.BROKEN
        assert len({r.replacement_id for r in rows}) == N
    finally:
        for d in drivers.values():
            await d.close()
        for _, proc in started:
            stop_peer(proc)
