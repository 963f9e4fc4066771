"""An elastic pool in the virtual rack, through the real boot path (docs/elastic.md).

A Slurm tenant run by metald gets a pool of min 0, max 3 (any of the rack's machines, the
tenant node image). Nothing is claimed until a job asks: ``sbatch -N4`` stays pending with
its reason and resumes nothing (max 3); ``sbatch -N2`` makes slurmctld run ResumeProgram for
e1, e2; metald claims one QEMU machine per name (keyed ``elastic:<pool>:<node>``), PXE-boots
them into the node image, they join the tenant's hub over WireGuard as ``slurmd -N e1`` /
``-N e2`` (the CLOUD names), and the job runs on them. Once the job ends and the pool's
SuspendTime passes, slurmctld runs SuspendProgram; metald releases both claims, the machines
are wiped and come back ready. Times are printed (job submitted -> running, idle -> back in
the pool), never asserted.

METALD_LAB_LONG=1 only: minutes of TCG boots (enrollment, two provisionings, two wipes).
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from typing import Any

import pytest

from metald.tenants import controlplane
from tests import waiting

pytestmark = [
    pytest.mark.lab,
    pytest.mark.root,
    pytest.mark.skipif(
        os.environ.get("METALD_LAB_LONG") != "1",
        reason="minutes of TCG boots (two provisionings, two wipes): METALD_LAB_LONG=1",
    ),
]

READY_TIMEOUT_S = 480
RESUME_TIMEOUT_S = 900
SUSPEND_TIME_S = 20


def ctl(rack, tenant_id: str, *argv: str, timeout: float = 60):  # type: ignore[no-untyped-def]
    return controlplane.exec_in(rack.state_dir, tenant_id, list(argv), timeout=timeout)


def sinfo(rack, tenant_id: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    r = ctl(rack, tenant_id, "sinfo", "-h", "-N", "-o", "%N %t")
    return dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)


def job_field(rack, tenant_id: str, job: str, field: str) -> str:  # type: ignore[no-untyped-def]
    out = ctl(rack, tenant_id, "scontrol", "show", "job", job).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith(field + "=")), "")


_IMAGE: dict[str, Any] = {}


def node_image(rack) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The tenant node image, served and registered once for this module's tests."""
    if "img" not in _IMAGE:
        _IMAGE["img"] = rack.json(
            "images", "create", "tenant-node-elastic", *rack.publish_node_image(8083)
        )
    return _IMAGE["img"]


def slurm_tenant(rack, name: str) -> str:  # type: ignore[no-untyped-def]
    st, t = rack.api("POST", "/api/v1/tenants", {"name": name, "cluster_kind": "slurm"})
    assert st == 201, t
    st, hub = rack.api("POST", f"/api/v1/tenants/{t['id']}/hub", {})
    assert st == 201, hub
    return str(t["id"])


def job_output(rack, tid: str, job: str) -> str:  # type: ignore[no-untyped-def]
    """The batch script's output, on its first node (sbatch's default file)."""
    host = job_field(rack, tid, job, "BatchHost")
    r = ctl(rack, tid, "srun", "-w", host, "-N1", "cat", f"/slurm-{job}.out", timeout=60)
    assert r.returncode == 0, r.stderr
    return str(r.stdout.strip())


def why_failed(rack, tid: str, job: str) -> str:  # type: ignore[no-untyped-def]
    """The job as slurmctld has it, its output and the slurmd logs of its nodes."""
    out = [ctl(rack, tid, "scontrol", "show", "job", job).stdout]
    nodes = job_field(rack, tid, job, "NodeList")
    host = job_field(rack, tid, job, "BatchHost")
    for argv in (
        ["srun", "-w", host, "-N1", "cat", f"/slurm-{job}.out"],
        ["srun", "-w", nodes, "-N2", "sh", "-c", "hostname; wg show wg0 peers"],
    ):  # fmt: skip
        r = ctl(rack, tid, *argv, timeout=60)
        out.append(f"$ {' '.join(argv)}\n{r.stdout}{r.stderr}")
    out.append(str(sinfo(rack, tid)))
    return "\n".join(out)


def phases(rack, mid: str) -> str:  # type: ignore[no-untyped-def]
    """Where a resumed machine's time went, from its events: claimed -> network boot (power-on,
    POST, iPXE: what a pre-warmed machine would skip) -> provisioned -> active (joined)."""
    items = sorted(rack.json("events", "--machine", mid, "--limit", "1000")["items"],
                   key=lambda e: e["id"])  # fmt: skip
    at = {}
    for e in items:
        step = (
            "claimed" if e["to_state"] == "claimed"
            else "network boot" if e["kind"] == "provision.network-boot"
            else e["to_state"] if e["to_state"] in ("provisioned", "active")
            else None
        )  # fmt: skip
        if step == "claimed":
            at = {"claimed": datetime.fromisoformat(e["at"])}
        elif step and at and step not in at:
            at[step] = datetime.fromisoformat(e["at"])
    if "claimed" not in at:
        return "no claim event"
    t0 = at["claimed"]
    return ", ".join(f"{k} +{(v - t0).total_seconds():.1f}s" for k, v in at.items())


def test_pool_grows_for_a_job_and_shrinks_when_idle(enrolled_rack) -> None:  # type: ignore[no-untyped-def]
    rack = enrolled_rack.rack
    macs = [m["mac"] for m in rack.machines]
    rack.wait_state(macs, "ready", READY_TIMEOUT_S)  # earlier tests' wipes are done

    def wait_for(what: str, fn, timeout: float, every: float = 2) -> Any:  # type: ignore[no-untyped-def]
        return waiting.wait_for(what, fn, timeout, every=every, explain=rack.diagnostics)

    st, t = rack.api("POST", "/api/v1/tenants", {"name": "elastic", "cluster_kind": "slurm"})
    assert st == 201, t
    tid = t["id"]
    st, hub = rack.api("POST", f"/api/v1/tenants/{tid}/hub", {})
    assert st == 201, hub
    img = node_image(rack)
    st, pool = rack.api(
        "POST",
        f"/api/v1/tenants/{tid}/elastic-pools",
        {"name": "gpu", "prefix": "e", "min_nodes": 0, "max_nodes": 3, "image_id": img["id"],
         "suspend_time_s": SUSPEND_TIME_S, "resume_timeout_s": RESUME_TIMEOUT_S},
    )  # fmt: skip
    assert st == 201, pool
    part = pool["partition"]

    def pool_nodes() -> dict[str, str]:
        st, p = rack.api("GET", f"/api/v1/tenants/{tid}/elastic-pools/{pool['id']}")
        assert st == 200, p
        return p["nodes"]

    # The control plane comes up with the CLOUD nodes, powered down: no machine claimed.
    wait_for("e1-e3 powered down in the tenant's cluster",
             lambda: sinfo(rack, tid) == {f"e{i}": "idle~" for i in (1, 2, 3)}, 120)  # fmt: skip
    assert pool_nodes() == {}

    # More nodes than the pool's max: pending with the reason, nothing resumed.
    r = ctl(rack, tid, "sbatch", "--parsable", "-p", part, "-N4", "--wrap", "true")
    assert r.returncode == 0, r.stderr
    big = r.stdout.strip()
    time.sleep(5)
    st_r = ctl(rack, tid, "squeue", "-h", "-j", big, "-o", "%T %r").stdout.split()
    assert st_r[0] == "PENDING" and st_r[1] in ("PartitionConfig", "PartitionNodeLimit"), st_r
    print(f"\nsbatch -N4 (pool max 3): {st_r[0]} ({st_r[1]})")
    assert pool_nodes() == {}
    assert ctl(rack, tid, "scancel", big).returncode == 0

    # Two nodes: claimed, provisioned, joined under the pool's names; the job runs on them.
    t0 = time.monotonic()
    # The batch script runs on the first node (the node image has slurmd, not srun): it prints
    # the machine's hostname, read back from there once the job is done.
    r = ctl(rack, tid, "sbatch", "--parsable", "-p", part, "-N2", "--wrap", "hostname; sleep 15")  # fmt: skip
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    claims = wait_for("claims for e1 and e2", lambda: (n := pool_nodes()) and len(n) == 2 and n, 60)  # fmt: skip
    t_claimed = time.monotonic() - t0
    assert sorted(claims) == ["e1", "e2"], claims
    machines = {}
    for node, cid in claims.items():
        c = rack.json("claims", "show", cid)
        assert c["idempotency_key"] == f"elastic:{pool['id']}:{node}", c
        (m,) = c["machines"]
        machines[node] = m["id"]
    assert len(set(machines.values())) == 2

    seen: dict[str, float] = {}

    def running() -> bool:
        state = job_field(rack, tid, job, "JobState")
        if state and state not in seen:
            seen[state] = time.monotonic() - t0
            print(f"  job {job}: {state} at +{seen[state]:.1f} s; nodes {sinfo(rack, tid)}")
        assert state not in ("FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT"), state
        return state in ("RUNNING", "COMPLETING", "COMPLETED")

    wait_for("the job running on the resumed nodes", running, RESUME_TIMEOUT_S, every=1)
    t_running = time.monotonic() - t0
    assert job_field(rack, tid, job, "NodeList") == "e[1-2]"
    states = {n: rack.json("machines", "show", mid)["state"] for n, mid in machines.items()}
    assert set(states.values()) == {"active"}, states
    for node, mid in sorted(machines.items()):
        print(f"  {node} ({mid[:8]}): {phases(rack, mid)}")
    wait_for("the job completed", lambda: job_field(rack, tid, job, "JobState") == "COMPLETED", 120, every=1)  # fmt: skip
    t_done = time.monotonic()
    assert job_field(rack, tid, job, "ExitCode") == "0:0"
    assert job_output(rack, tid, job).startswith("vmlab-")
    assert pool_nodes() == claims  # no second claim for a name while it ran

    # Idle for SuspendTime: SuspendProgram -> claims released -> wiped -> ready.
    wait_for("the pool's claims released", lambda: pool_nodes() == {}, SUSPEND_TIME_S + 120)
    t_released = time.monotonic() - t_done
    for cid in claims.values():
        assert rack.json("claims", "show", cid)["state"] == "released"
    wait_for(
        "the released machines wiped and ready",
        lambda: {rack.json("machines", "show", m)["state"] for m in machines.values()} == {"ready"},
        READY_TIMEOUT_S,
    )
    t_ready = time.monotonic() - t_done
    # The names are free again: the cluster keeps them as powered-down CLOUD nodes.
    nodes = sinfo(rack, tid)
    assert set(nodes) == {"e1", "e2", "e3"}, nodes
    print(
        f"\nelastic QEMU proof (SuspendTime {SUSPEND_TIME_S} s): sbatch -N2 -> 2 claims "
        f"{t_claimed:.1f} s; submitted -> RUNNING {t_running:.1f} s "
        f"(states: {', '.join(f'{k} +{v:.1f}s' for k, v in seen.items())}); "
        f"COMPLETED -> claims released {t_released:.1f} s; COMPLETED -> both wiped and ready "
        f"{t_ready:.1f} s; load {os.getloadavg()}"
    )


def test_node_down_for_want_of_a_machine_resumes_once_another_tenant_frees_one(
    enrolled_rack,
) -> None:  # type: ignore[no-untyped-def]
    """Two tenants want the last machines: another tenant's claim holds 2 of the 3, so
    ``sbatch -N2`` gets a machine for e1 and e2 is set down (``sinfo -R`` shows why, an
    ``elastic.no-machine`` event). The other tenant releases its claim; once its machines are
    wiped and ready, metald retries e2 (an ``elastic.retry`` event): claimed, provisioned,
    joined, and the job (requeued by slurmctld when e2 went down) completes."""
    rack = enrolled_rack.rack
    macs = [m["mac"] for m in rack.machines]
    rack.wait_state(macs, "ready", READY_TIMEOUT_S)

    def wait_for(what: str, fn, timeout: float, every: float = 2) -> Any:  # type: ignore[no-untyped-def]
        return waiting.wait_for(what, fn, timeout, every=every, explain=rack.diagnostics)

    img = node_image(rack)
    holder = slurm_tenant(rack, "holder")
    held = rack.json("claims", "create", "--tenant", holder, "--count", "2", "--image", img["id"])
    tid = slurm_tenant(rack, "elastic2")
    st, pool = rack.api(
        "POST",
        f"/api/v1/tenants/{tid}/elastic-pools",
        {"name": "gpu", "prefix": "e", "min_nodes": 0, "max_nodes": 3, "image_id": img["id"],
         "suspend_time_s": SUSPEND_TIME_S, "resume_timeout_s": RESUME_TIMEOUT_S},
    )  # fmt: skip
    assert st == 201, pool
    wait_for("e1-e3 in the tenant's cluster", lambda: set(sinfo(rack, tid)) == {"e1", "e2", "e3"}, 120)  # fmt: skip

    def pool_nodes() -> dict[str, str]:
        st, p = rack.api("GET", f"/api/v1/tenants/{tid}/elastic-pools/{pool['id']}")
        assert st == 200, p
        return dict(p["nodes"])

    def reasons() -> dict[str, str]:
        out = ctl(rack, tid, "sinfo", "-R", "-h", "-N", "-o", "%N|%E").stdout
        return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)

    t0 = time.monotonic()
    r = ctl(rack, tid, "sbatch", "--parsable", "-p", pool["partition"], "-N2", "--wrap", "hostname")  # fmt: skip
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    wait_for("e2 set down for want of a machine",
             lambda: reasons().get("e2", "").startswith("elastic: no free machine"), 60)  # fmt: skip
    assert list(pool_nodes()) == ["e1"]
    st, page = rack.api("GET", "/api/v1/events?kind=elastic.no-machine&limit=1000")
    assert st == 200, page
    assert any(e["tenant_id"] == tid and "e2" in (e["reason"] or "") for e in page["items"]), page
    print(f"\nsinfo -R in the tenant's cluster: e2|{reasons()['e2']}")

    # The other tenant lets its machines go: wiped, ready, and e2 is retried.
    wait_for("the holder's machines provisioned",
             lambda: {rack.json("machines", "show", m["id"])["state"] for m in held["machines"]}
             <= {"active", "provisioned", "joining"}, READY_TIMEOUT_S)  # fmt: skip
    rack.ctl("claims", "release", held["id"], "--yes")
    t_freed = time.monotonic()
    wait_for("e2 claimed once a machine is free", lambda: "e2" in pool_nodes(), READY_TIMEOUT_S)
    t_retried = time.monotonic() - t_freed
    st, page = rack.api("GET", "/api/v1/events?kind=elastic.retry&limit=1000")
    assert st == 200, page
    assert any(e["tenant_id"] == tid and "e2" in e["data"]["nodes"] for e in page["items"]), page

    def state() -> str:
        s = job_field(rack, tid, job, "JobState")
        assert s not in ("FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT"), why_failed(rack, tid, job)
        return s

    wait_for("the job completed", lambda: state() == "COMPLETED", RESUME_TIMEOUT_S)
    nodes = job_field(rack, tid, job, "NodeList")
    assert job_field(rack, tid, job, "ExitCode") == "0:0"
    assert job_output(rack, tid, job).startswith("vmlab-")
    claims = pool_nodes()
    assert nodes in ("e[1-2]", "e[1,3]", "e[2-3]"), nodes
    assert "e2" in claims and len(set(claims.values())) == len(claims)
    print(
        f"elastic retry on QEMU machines: release -> e2 claimed {t_retried:.1f} s (the wipe); "
        f"sbatch -> COMPLETED on {nodes} {time.monotonic() - t0:.1f} s; claims {sorted(claims)}; "
        f"load {os.getloadavg()}"
    )
