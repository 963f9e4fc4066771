"""The tenant scheduler interface on a real Slurm: slurmctld in a tenant control plane
(``SlurmControlPlane``, its runner) and a dynamic slurmd node in another namespace. Drain with
a reason that ``sinfo -R`` shows, the state read back, undrain, remove while a job runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from metald.health.scheduler import NodeState, SchedulerError, TenantScheduler
from metald.tenants import controlplane, slurm
from metald.tenants.scheduler import SlurmScheduler
from tests.tenants.nslab import underlay, wait_for

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(
        not all(shutil.which(x) for x in ("slurmctld", "slurmd", "sinfo", "squeue", "munged")),
        reason="needs slurmctld slurmd slurm-client munge",
    ),
]

REASON = "metald: XID 79 on GPU 0000:3b:00 (GPU has fallen off the bus.)"


def test_drain_state_undrain_remove_on_a_real_slurm(tmp_path: Path) -> None:
    key = slurm.generate_munge_key()
    with underlay() as u:
        cp = controlplane.SlurmControlPlane(
            "t1", "acme", u.hub_ns, tmp_path / "ctl", u.hub_ip, key, max_nodes=8
        )
        node = None
        try:
            cp.start()
            jm = slurm.join_material(hub_address=u.hub_ip, munge_key=key, node_name="gpu-a1")
            node = controlplane.start_machine(
                u.node_ns, "gpu-a1", tmp_path / "node", key, "slurmd", "-D", *jm["slurmd_args"]
            )
            sched: TenantScheduler = SlurmScheduler(cp.run)

            def state() -> NodeState | None:
                try:
                    return sched.node_state("gpu-a1").state
                except SchedulerError:  # the control plane's munged is still starting
                    return None

            assert wait_for(lambda: state() == NodeState.IDLE, 30), (
                tmp_path / "node" / "out.log"
            ).read_text()[-2000:]
            assert sched.running_jobs("gpu-a1") == []
            job = cp.run("sbatch", "-N1", "-w", "gpu-a1", "--wrap", "sleep 300")
            assert job.returncode == 0, job.stderr
            assert wait_for(lambda: state() == NodeState.ALLOCATED, 15)
            (job_id,) = sched.running_jobs("gpu-a1")
            assert job.stdout.split()[-1] == job_id

            sched.drain("gpu-a1", REASON)
            sched.drain("gpu-a1", REASON)  # idempotent
            st = sched.node_state("gpu-a1")
            assert (st.state, st.reason) == (NodeState.DRAINING, REASON)
            sinfo = cp.run("sinfo", "-R", "-h", "-N", "-o", "%N|%E").stdout
            assert sinfo.strip() == f"gpu-a1|{REASON}"
            assert SlurmScheduler(cp.run).drain_reasons() == {"gpu-a1": REASON}
            assert "metald: XID 79 on GP" in cp.run("sinfo", "-R").stdout  # its 20 columns
            assert sched.running_jobs("gpu-a1") == [job_id]  # drained: the job goes on

            sched.undrain("gpu-a1")
            sched.undrain("gpu-a1")  # idempotent
            # Slurm marks a resumed node not responding until its next ping answers
            assert wait_for(lambda: state() == NodeState.ALLOCATED, 30), state()
            assert cp.run("sinfo", "-R", "-h").stdout.strip() == ""

            sched.drain("gpu-a1", REASON)

            def removed() -> bool:
                try:  # refused while the ended job still completes: the workflow retries
                    sched.remove_node("gpu-a1", "metald: taken out of the claim")
                except SchedulerError:
                    return False
                return True

            assert wait_for(removed, 30)
            assert state() == NodeState.ABSENT
            assert sched.running_jobs("gpu-a1") == []
            ended = cp.run("squeue", "-h", "-j", job_id, "-t", "RUNNING", "-o", "%i")
            assert ended.stdout.strip() == "", ended
            sched.remove_node("gpu-a1", "again")  # absent: done

            with pytest.raises(SchedulerError, match="scontrol update nodename=nosuch failed"):
                sched.drain("nosuch", REASON)
        finally:
            controlplane.stop_process(node)
            cp.stop()
