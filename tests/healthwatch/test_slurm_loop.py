"""The whole remediation against the tenant's real Slurm: slurmctld in a tenant control plane
and a dynamic slurmd node running a job. A fatal fault (the node's XID 79, as its report
brings it) drains the node with ``metald: <evidence>`` as the reason ``sinfo -R`` shows, the
job runs on until ``job_wait_s``, then the node is set down and deleted, a spare of the
claim's selector replaces it and the bad machine goes to repair with its evidence. Prints
fault -> drained as measured here."""

from __future__ import annotations

import asyncio
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from metald.health.remediation import Step
from metald.health.scheduler import NodeState, SchedulerError
from metald.health.signals import Kind, Signal, Witness
from metald.healthwatch.watch import HealthWatch, record_signals
from metald.lifecycle import State
from metald.store import Store
from metald.store.models import Machine
from metald.tenants import controlplane, slurm
from metald.tenants.scheduler import SlurmScheduler
from tests.healthwatch.helpers import (
    active_claim,
    claim_members,
    events,
    health_cfg,
    node_name,
    rem_rows,
    workflow,
)
from tests.tenants.nslab import underlay, wait_for

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(
        not all(shutil.which(x) for x in ("slurmctld", "slurmd", "sinfo", "squeue", "munged")),
        reason="needs slurmctld slurmd slurm-client munge",
    ),
]

XID79 = "[ 812.5] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus."


async def test_drain_wait_remove_replace_repair_on_a_real_slurm(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'metald.db'}")
    store.migrate()
    c = active_claim(store, 1, spares=1)
    bad = c.machines[0]
    node = node_name(store, bad)
    key = slurm.generate_munge_key()
    cfg = health_cfg(job_wait_s=3)
    with underlay() as u:
        cp = controlplane.SlurmControlPlane(
            "t1", "acme", u.hub_ns, tmp_path / "ctl", u.hub_ip, key, max_nodes=8
        )
        proc = None
        try:
            cp.start()
            jm = slurm.join_material(hub_address=u.hub_ip, munge_key=key, node_name=node)
            proc = controlplane.start_machine(
                u.node_ns, node, tmp_path / "node", key, "slurmd", "-D", *jm["slurmd_args"]
            )
            sched = SlurmScheduler(cp.run)

            def state() -> NodeState | None:
                try:
                    return sched.node_state(node).state
                except SchedulerError:
                    return None

            assert wait_for(lambda: state() == NodeState.IDLE, 30)
            assert sched.node_states()[node].state == NodeState.IDLE  # the watch's bulk read
            job = cp.run("sbatch", "-N1", "-w", node, "--wrap", "sleep 300")
            assert job.returncode == 0, job.stderr
            job_id = job.stdout.split()[-1]
            assert wait_for(lambda: state() == NodeState.ALLOCATED, 15)

            wf = workflow(store, sched, cfg)
            watch = HealthWatch(store, cfg, "i1", remediations=wf, table=cfg.table(),
                                scheduler_for=lambda _t: sched)  # fmt: skip
            t0 = time.monotonic()
            sig = Signal(Kind.XID, Witness.NODE, "0000:3b:00", "79", datetime.now(UTC), XID79)
            with store.session() as s:
                record_signals(s, bad, [sig], cfg=cfg, table=cfg.table(),
                               now=datetime.now(UTC), actor="node", instance="i1")  # fmt: skip
            await watch.round(reads=False)
            drained = time.monotonic() - t0
            print(f"node fault recorded -> drained in the tenant's Slurm: {drained * 1000:.0f} ms")
            st = sched.node_state(node)
            assert st.state == NodeState.DRAINING, st
            assert st.reason == f"metald: {XID79}"
            sinfo = cp.run("sinfo", "-R", "-h", "-N", "-o", "%N|%E").stdout.strip()
            assert sinfo == f"{node}|metald: {XID79}"
            assert sched.running_jobs(node) == [job_id]  # drained: the job goes on
            (row,) = rem_rows(store)
            assert row.step == Step.WAIT_JOBS

            async def done() -> bool:
                await watch.round(reads=False)
                return rem_rows(store)[0].step == Step.DONE

            deadline = time.monotonic() + 60
            while not await done():
                assert time.monotonic() < deadline, rem_rows(store)[0].reason
                await asyncio.sleep(0.5)
            assert state() == NodeState.ABSENT
            ended = cp.run("squeue", "-h", "-j", job_id, "-t", "RUNNING", "-o", "%i")
            assert ended.stdout.strip() == ""
            (row,) = rem_rows(store)
            with store.session() as s:
                assert claim_members(s, c.claim_id) == [c.spares[0]] == [row.replacement_id]
                assert s.get(Machine, c.spares[0]).state == State.PROVISIONING
                assert s.get(Machine, bad).state == State.BROKEN
            kinds = [e.kind for e in events(store, "health.remediation.")]
            assert kinds[:3] == ["health.remediation.opened", "health.remediation.drain",
                                 "health.remediation.wait-jobs"]  # fmt: skip
            assert kinds[-3:] == ["health.remediation.replace", "health.remediation.repair",
                                  "health.remediation.done"]  # fmt: skip
            deadline_ev = [e for e in events(store, "health.remediation.remove")]
            assert "after 3 s: taking" in deadline_ev[0].reason
        finally:
            controlplane.stop_process(proc)
            cp.stop()
            store.close()
