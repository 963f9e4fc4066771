"""The health watch: a real OpenIPMI ipmi_sim BMC's SEL read incrementally (records added with
Add SEL Entry, as the lab's fault injection does) through metald's IPMI driver, each record
signalled once, and the node drained; node silence (on by default, never for a node that has
not reported yet); reads only by the BMC's owner."""

from __future__ import annotations

import asyncio
import shutil
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlmodel import select

from metald.bmc.base import BmcEndpoint
from metald.bmc.ipmi import IpmiDriver
from metald.health.remediation import Step
from metald.health.scheduler import NodeState
from metald.healthwatch.watch import HealthWatch
from metald.store.models import Bmc, BmcLogCursor, HealthFault, NodeHeartbeat
from tests.bmc.peers import IpmiSim
from tests.healthwatch.helpers import (
    FakeScheduler,
    active_claim,
    bmc_fault,
    health_cfg,
    node_name,
    rem_rows,
    workflow,
)
from vmlab import faults as lab_faults


class DriverReads:
    """The BMC service's event-log and sensor reads, over one driver (what ``BmcService``
    renders), counting reads."""

    def __init__(self, driver: IpmiDriver) -> None:
        self.driver = driver
        self.reads = 0

    async def event_log(self, machine_id: str) -> list[dict[str, Any]]:
        self.reads += 1
        return [
            {"id": e.id, "at": e.at.isoformat() if e.at else None, "severity": e.severity,
             "message": e.message}
            for e in await self.driver.event_log()
        ]  # fmt: skip

    async def sensors(self, machine_id: str) -> list[dict[str, Any]]:
        return []


def _bmc_row(store: Any, machine_id: str, port: int) -> str:
    with store.session() as s:
        b = Bmc(machine_id=machine_id, address="127.0.0.1", port=port, protocol="ipmi",
                username="u", password_enc=b"x")  # fmt: skip
        s.add(b)
        s.commit()
        return b.id


class _Owner:
    def __init__(self, bmcs: bool) -> None:
        self.bmcs = bmcs
        self.fenced = False

    def owns_bmc(self, bmc_id: str, address: str) -> bool:
        return self.bmcs

    def owns_hub(self, tenant_id: str) -> bool:
        return True

    def hub_owner(self, tenant_id: str) -> str | None:
        return "i1"

    def owns_key(self, key: str) -> bool:
        return False

    def owns_machine(self, machine_id: str, bmc: Any) -> bool:
        return self.bmcs if bmc is not None else True


@pytest.mark.skipif(shutil.which("ipmitool") is None, reason="needs ipmitool")
async def test_sel_records_are_read_incrementally_and_the_node_drained(
    store, ipmi_sim: IpmiSim
) -> None:  # type: ignore[no-untyped-def]
    c = active_claim(store, 1, spares=1)
    bmc_id = _bmc_row(store, c.machines[0], ipmi_sim.port)
    cfg = health_cfg(job_wait_s=3600)
    sched = FakeScheduler()
    node = node_name(store, c.machines[0])
    sched.jobs[node] = ["7"]
    driver = IpmiDriver(
        BmcEndpoint("127.0.0.1", ipmi_sim.port, ipmi_sim.username, ipmi_sim.password),
        request_timeout_s=5.0,
        resend_s=0.3,
    )
    reads = DriverReads(driver)
    target = lab_faults.BmcTarget("127.0.0.1", ipmi_sim.port, ipmi_sim.username,
                                  ipmi_sim.password)  # fmt: skip
    try:
        # Not the owner: nothing read.
        other = HealthWatch(store, cfg, "i2", remediations=workflow(store, sched, cfg, "i2"),
                            table=cfg.table(), bmc=reads, ownership=_Owner(False))  # fmt: skip
        await other.round(reads=True)
        assert reads.reads == 0
        watch = HealthWatch(store, cfg, "i1", remediations=workflow(store, sched, cfg),
                            table=cfg.table(), bmc=reads, ownership=_Owner(True))  # fmt: skip
        await watch.round(reads=True)  # the first read sets the cursor: older records judge nothing
        with store.session() as s:
            cur = s.get(BmcLogCursor, bmc_id)
            assert cur is not None and cur.reader == "i1"
            baseline = cur.entries
        assert rem_rows(store) == []

        rid = await asyncio.to_thread(
            lab_faults.add_sel, target, lab_faults.memory_uncorrectable_ecc(dimm=2)
        )
        t0 = time.monotonic()
        await watch.round(reads=True)
        fault_to_drained = time.monotonic() - t0
        print(f"SEL record -> drained (one watch round, IPMI read included): "
              f"{fault_to_drained * 1000:.0f} ms")  # fmt: skip
        (row,) = rem_rows(store)
        assert row.step == Step.WAIT_JOBS and row.severity == "fatal"
        assert sched.drained[node].startswith(f"metald: #{rid} ")
        assert "ncorrectable" in sched.drained[node]
        with store.session() as s:
            (f,) = s.exec(select(HealthFault)).all()
            assert (f.witness, f.kind, f.rule) == ("bmc", "sel", "sel-memory-uncorrectable")
            assert s.get(BmcLogCursor, bmc_id).last_id == str(rid)
            assert s.get(BmcLogCursor, bmc_id).entries == baseline + 1

        await watch.round(reads=True)  # the same log again: nothing new
        with store.session() as s:
            assert [x.count for x in s.exec(select(HealthFault)).all()] == [1]

        await asyncio.to_thread(lab_faults.add_sel, target, lab_faults.psu_failure())
        await watch.round(reads=True)
        with store.session() as s:
            rules = sorted(x.rule for x in s.exec(select(HealthFault)).all())
            assert rules == ["sel-memory-uncorrectable", "sel-psu-fatal"]
        assert reads.reads == 4
    finally:
        await driver.close()


async def test_silence_is_judged_only_after_a_first_report(store) -> None:  # type: ignore[no-untyped-def]
    c = active_claim(store, 2, spares=2)
    cfg = health_cfg()
    assert cfg.node_silence_s == 60  # on by default
    sched = FakeScheduler()
    now = [datetime.now(UTC)]
    wf = workflow(store, sched, cfg)
    wf.clock = lambda: now[0]
    watch = HealthWatch(store, cfg, "i1", remediations=wf, table=cfg.table(),
                        clock=lambda: now[0])  # fmt: skip
    with store.session() as s:  # the first machine's agent reported once; the second never
        s.add(NodeHeartbeat(machine_id=c.machines[0], claim_id=c.claim_id, last_at=now[0],
                            reports=1))  # fmt: skip
        # An old report from an earlier claim of the second machine: not this claim's
        s.add(NodeHeartbeat(machine_id=c.machines[1], claim_id="an-earlier-claim",
                            last_at=now[0], reports=9))  # fmt: skip
        s.commit()
    now[0] += timedelta(seconds=59)
    await watch.round(reads=False)
    assert rem_rows(store) == []
    now[0] += timedelta(seconds=2)
    await watch.round(reads=False)
    (row,) = rem_rows(store)
    assert row.machine_id == c.machines[0] and row.step == Step.DONE  # job_wait_s 0
    with store.session() as s:
        (f,) = s.exec(select(HealthFault)).all()
        assert (f.witness, f.rule, f.severity) == ("metald", "node-silent", "fatal")
        assert "no node report since" in f.evidence


async def test_the_schedulers_down_is_a_fault_and_its_own_clear_ends_it(store) -> None:  # type: ignore[no-untyped-def]
    c = active_claim(store, 2, spares=0)
    cfg = health_cfg()
    sched = FakeScheduler()
    node = node_name(store, c.machines[0])
    sched.states[node] = NodeState.DOWN
    wf = workflow(store, sched, cfg)
    watch = HealthWatch(store, cfg, "i1", remediations=wf, table=cfg.table(),
                        scheduler_for=lambda _t: sched)  # fmt: skip
    await watch.round(reads=True)
    with store.session() as s:
        (f,) = s.exec(select(HealthFault)).all()
        assert (f.witness, f.rule, f.severity) == ("scheduler", "scheduler-down", "degraded")
        assert f.machine_id == c.machines[0]
    (row,) = rem_rows(store)
    assert row.step == Step.DRAINED and sched.drained[node].startswith("metald: scheduler:")
    # The node answers again (drained by the remediation): the scheduler's own degraded
    # fault clears and the node is undrained.
    del sched.states[node]
    await watch.round(reads=True)
    (row,) = rem_rows(store)
    assert row.step == Step.DONE and ("undrain", node) in sched.calls
    with store.session() as s:
        (f,) = s.exec(select(HealthFault)).all()
        assert f.cleared_by == "scheduler" and f.open_key is None


async def test_faults_of_a_machine_back_in_the_pool_are_closed(store) -> None:  # type: ignore[no-untyped-def]
    from metald import machines as ms
    from metald.lifecycle import Trigger

    c = active_claim(store, 1, spares=0)
    cfg = health_cfg()
    bmc_fault(store, c.machines[0], cfg)
    with store.session() as s:  # out of its claim by hand, wiped, ready again
        for trig in (Trigger.RELEASE, Trigger.WIPE, Trigger.WIPED):
            ms.transition(s, c.machines[0], trig, actor="t",
                          updates={"tenant_id": None, "wipe_required": False})  # fmt: skip
    watch = HealthWatch(store, cfg, "i1", remediations=workflow(store, FakeScheduler(), cfg),
                        table=cfg.table())  # fmt: skip
    await watch.round(reads=False)
    with store.session() as s:
        (f,) = s.exec(select(HealthFault)).all()
        assert f.cleared_by == "back in the pool" and f.open_key is None
