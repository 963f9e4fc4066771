"""Day 2 in the QEMU lab: a tenant's node goes bad under a running job and metald drains it in
the tenant's real Slurm, lets the job finish, replaces it and hands it to the technicians.

A rack of its own (5 BIOS machines: 2 claimed, 3 spares; every BMC driven over IPMI: the lab's
virtual BMCs keep a System Event Log, vmlab.vsel) with the health loop's intervals shortened.
Tenant alpha claims 2 machines with the tenant node image; they join alpha's Slurm over
WireGuard (real slurmd, real slurmctld beside metald) and a 2-node job runs on them. Then:

(a) an uncorrectable-ECC record is added to one node's BMC event log (IPMI Add SEL Entry,
    ``vmlab.faults.add_sel``): metald's read of that log finds it, the node is drained in
    alpha's Slurm with a ``metald:`` reason while the job still runs, the job completes (the
    policy waits up to ``job_wait_s``), the node leaves the claim and Slurm, a spare of the
    claim's selector is provisioned and joins, ``srun -N2`` runs, and the bad machine is in the
    repair queue (GET /api/v1/repairs) with the SEL record as evidence;
(b) the lab's stand-in ``nvidia-smi`` (vm-lab/nvidia-smi-standin), switched to XID 79, is put
    on the other node's PATH through srun (the tenant is root on its nodes): its first call
    writes the driver's XID 79 line to the kernel log, the node agent's next report carries it,
    and the node is drained, replaced and queued for repair with that line as evidence;
(c) one of the nodes then has its QEMU paused (QMP stop, ``vmlab.faults.pause``): its agent
    stops reporting, and after ``node_silence_s`` it is drained and replaced the same way.

Fault -> drained and fault -> replacement joined are printed with the claim's own provisioning
time beside them (docs/health.md). It takes 6 to 12 minutes of TCG boots here: it runs with
METALD_LAB_LONG=1 (``make test-long``) only.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from metald.provision.metadata import hostname
from metald.tenants import controlplane
from tests.e2e.conftest import RULES, lab_skip_reason

pytestmark = [pytest.mark.lab, pytest.mark.root]

READY_TIMEOUT_S = 480
ACTIVE_TIMEOUT_S = 480
JOB_S = 60
SILENCE_S = 20
HEALTH = (
    "[health]\nbmc_interval_s = 2\nwatch_interval_s = 1\nreport_interval_s = 5\n"
    f"report_min_interval_s = 1\nnode_silence_s = {SILENCE_S}\n"
    '[health.policy]\nfatal = "replace"\njob_wait_s = 180\n'
    "[health.limits]\nper_claim = 1\nper_rack = 2\n"
)


def until(what: str, cond: Callable[[], Any], timeout: float, rack: Any, every: float = 0.5) -> Any:
    """Poll ``cond`` until it holds; the deadline only stops a hung test."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{rack.diagnostics()}")
        time.sleep(every)
    return got


@pytest.fixture
def rack(tmp_path: Path) -> Iterator[Any]:
    if not os.environ.get("METALD_LAB_LONG"):
        pytest.skip("6 to 12 minutes of TCG boots: set METALD_LAB_LONG=1 (make test-long)")
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    from vmlab.rack import LabRack, tenants_config

    r = LabRack(
        f"hl{os.getpid() % 10000}",
        tmp_path / "rack",
        machines=5,
        uefi=0,
        extra_config=lambda state: RULES + HEALTH + tenants_config(state),
    )
    try:
        bmcs = r.register_bmcs(["ipmi"])
        for m in r.machines:
            r.ctl("bmcs", "power", bmcs[m["name"]]["id"], "on")
        r.wait_state([m["mac"] for m in r.machines], "ready", READY_TIMEOUT_S)
        yield r
    finally:
        r.down()


def ctl_exec(rack: Any, tenant_id: str, *argv: str, timeout: float = 60, **kw: Any) -> Any:
    return controlplane.exec_in(rack.state_dir, tenant_id, list(argv), timeout=timeout, **kw)


def sinfo(rack: Any, tenant_id: str) -> dict[str, str]:
    r = ctl_exec(rack, tenant_id, "sinfo", "-h", "-N", "-o", "%N %t")
    return dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)


def show_node(rack: Any, tenant_id: str, node: str) -> str:
    return str(ctl_exec(rack, tenant_id, "scontrol", "show", "node", node).stdout)


def drained(rack: Any, tenant_id: str, node: str) -> str | None:
    """``scontrol show node`` once the node carries metald's drain reason."""
    out = show_node(rack, tenant_id, node)
    return out if "Reason=metald:" in out else None


def start_in(rack: Any, tenant_id: str, *argv: str) -> subprocess.Popen[str]:
    """``argv`` started inside the tenant's control plane (``controlplane.exec_in``, without
    waiting for it)."""
    info = json.loads((rack.state_dir / "tenants" / tenant_id / "slurm" / controlplane.INFO).read_text())  # fmt: skip
    return subprocess.Popen(
        controlplane.exec_argv(int(info["pid"]), list(argv)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, SLURM_CONF=info["slurm_conf"]),
    )


def running_job(rack: Any, tenant_id: str) -> str | None:
    r = ctl_exec(rack, tenant_id, "squeue", "-h", "-t", "RUNNING", "-o", "%i")
    jobs = r.stdout.split()
    return jobs[0] if len(jobs) == 1 else None


A100_XML = (
    Path(__file__).resolve().parents[2]
    / "tests/fixtures/gpu/nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml"
)


def put(rack: Any, tenant_id: str, node: str, dest: str, text: str) -> None:
    """``text`` written to ``dest`` on ``node`` (executable), through srun: the tenant is root
    on its nodes."""
    r = ctl_exec(rack, tenant_id, "srun", "-w", node, "sh", "-c",
                 'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod 0755 "$1"', "put", dest,
                 input=text, timeout=120)  # fmt: skip
    assert r.returncode == 0, (dest, r.stdout, r.stderr)


def install_standin(rack: Any, tenant_id: str, node: str, folder: Path) -> None:
    """The lab's stand-in nvidia-smi (``vmlab.faults.install_gpu_standin``) in /opt/nvsmi on
    ``node``, already switched to XID 79, but not yet on the node agent's PATH."""
    from vmlab.faults import install_gpu_standin

    install_gpu_standin(folder, A100_XML.read_text(), mode="xid79")
    for name in ("bin/nvidia-smi", "mode", "xid79.line", "xid79.xml"):
        put(rack, tenant_id, node, f"/opt/nvsmi/{name}", (folder / name).read_text())


def job_state(rack: Any, tenant_id: str, job: str) -> str:
    out = ctl_exec(rack, tenant_id, "scontrol", "show", "job", job).stdout
    m = re.search(r"JobState=(\S+)", out)
    return m.group(1) if m else "?"


def store(rack: Any, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """A read of metald's SQLite store (read-only): what no API shows (BMC cursors, node
    heartbeats) and the test waits on before injecting a fault."""
    db = sqlite3.connect(f"file:{rack.state_dir / 'metald.db'}?mode=ro", uri=True, timeout=10)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def bmc_read(rack: Any, machine_id: str) -> bool:
    """metald has read the machine's BMC event log at least once (its cursor is set: only
    entries added after it are judged)."""
    return bool(store(rack, "SELECT 1 FROM bmc_log_cursors c JOIN bmcs b ON b.id = c.bmc_id "
                            "WHERE b.machine_id = ?", machine_id))  # fmt: skip


def reported(rack: Any, machine_id: str) -> bool:
    """The machine's node agent has reported (which arms the silence check)."""
    return bool(store(rack, "SELECT 1 FROM node_heartbeats WHERE machine_id = ? AND reports > 0",
                      machine_id))  # fmt: skip


def lab_machine(rack: Any, machine_id: str) -> dict[str, Any]:
    macs = {n["mac"] for n in rack.json("machines", "show", machine_id)["nics"]}
    (m,) = [m for m in rack.machines if m["mac"] in macs]
    return dict(m)


def claim_ids(rack: Any, claim_id: str) -> set[str]:
    st, c = rack.api("GET", f"/api/v1/claims/{claim_id}")
    assert st == 200, c
    return {m["id"] for m in c["machines"]}


def node_of(rack: Any, machine_id: str) -> str:
    return hostname(machine_id, rack.json("machines", "show", machine_id).get("name"))


def replaced(
    rack: Any, tenant_id: str, claim_id: str, bad: str, before: set[str]
) -> tuple[str, str] | None:
    """The claim's replacement for ``bad``, once it is active and idle in the tenant's Slurm
    and ``bad``'s node is gone from it: (machine id, node name)."""
    now = claim_ids(rack, claim_id)
    new = now - before
    if bad in now or len(new) != 1:
        return None
    (rid,) = new
    if rack.json("machines", "show", rid)["state"] != "active":
        return None
    nodes = sinfo(rack, tenant_id)
    node = node_of(rack, rid)
    if nodes.get(node) != "idle" or len(nodes) != len(before):
        return None
    return rid, node


def repair_of(rack: Any, machine_id: str) -> dict[str, Any] | None:
    st, page = rack.api("GET", "/api/v1/repairs?limit=100")
    assert st == 200, page
    return next((r for r in page["items"] if r["machine_id"] == machine_id), None)


def test_bad_node_drained_replaced_and_queued_for_repair(rack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from vmlab.faults import BmcTarget, add_sel, memory_uncorrectable_ecc, pause

    st, t = rack.api("POST", "/api/v1/tenants", {"name": "alpha", "cluster_kind": "slurm"})
    assert st == 201, t
    st, hub = rack.api("POST", f"/api/v1/tenants/{t['id']}/hub", {})
    assert st == 201, hub
    tid = t["id"]
    img = rack.json("images", "create", "tenant-node", *rack.publish_node_image())
    t0 = time.monotonic()
    claim = rack.json("claims", "create", "--tenant", tid, "--count", "2", "--image", img["id"])
    ids = {m["id"] for m in claim["machines"]}

    def all_active() -> bool:
        return all(rack.json("machines", "show", i)["state"] == "active" for i in ids)

    until("both nodes active", all_active, ACTIVE_TIMEOUT_S, rack, every=2)
    t_provision = time.monotonic() - t0
    nodes = sinfo(rack, tid)
    assert sorted(nodes.values()) == ["idle", "idle"], nodes

    # A job on both nodes (one task each), running when the fault comes.
    srun = start_in(rack, tid, "srun", "-N2", "sleep", str(JOB_S))
    job = until("the job running", lambda: running_job(rack, tid), 60, rack)

    # (a) An uncorrectable ECC record in one node's BMC event log.
    bad = sorted(ids)[0]
    bad_node = node_of(rack, bad)
    until("metald's first read of the BMC's log", lambda: bmc_read(rack, bad), 60, rack)
    bm = lab_machine(rack, bad)["bmc"]
    target = BmcTarget(bm["address"], int(bm["ipmi_port"]), bm["username"], bm["password"],
                       rack.lab.netns)  # fmt: skip
    tf = time.monotonic()
    record_id = add_sel(target, memory_uncorrectable_ecc(dimm=3))
    shown = until(
        "the node drained in the tenant's Slurm",
        lambda: drained(rack, tid, bad_node),
        60,
        rack,
        every=0.25,
    )
    t_drained = time.monotonic() - tf
    assert re.search(r"State=\S*DRAIN", shown), shown
    assert re.search(r"(?i)Reason=metald: .*uncorrectable", shown), shown
    r = ctl_exec(rack, tid, "sinfo", "-R", "-h", "-N", "-o", "%N|%E")
    assert any(line.startswith(f"{bad_node}|metald:") for line in r.stdout.splitlines()), r.stdout
    # Drained, not killed: the job still runs there, and then completes.
    assert job_state(rack, tid, job) == "RUNNING"
    assert bad in claim_ids(rack, claim["id"])
    out, err = srun.communicate(timeout=JOB_S + 60)
    t_job = time.monotonic() - tf
    until(
        "the job's end in Slurm",
        lambda: job_state(rack, tid, job) not in ("RUNNING", "COMPLETING"),
        60,
        rack,
    )
    shown = ctl_exec(rack, tid, "scontrol", "show", "job", job).stdout
    assert srun.returncode == 0 and "JobState=COMPLETED" in shown, (
        out,
        err,
        shown,
        [(e["kind"], e.get("message")) for e in rack.json("events", "--machine", bad)["items"]],
    )

    rid, rnode = until(
        "the replacement active and idle in the tenant's Slurm",
        lambda: replaced(rack, tid, claim["id"], bad, ids),
        ACTIVE_TIMEOUT_S,
        rack,
        every=1,
    )
    t_joined = time.monotonic() - tf
    assert bad_node not in sinfo(rack, tid)
    r = ctl_exec(rack, tid, "srun", "-N2", "hostname")
    kept = node_of(rack, next(iter(ids - {bad})))
    assert r.returncode == 0 and sorted(r.stdout.split()) == sorted([kept, rnode]), (
        r.stdout,
        r.stderr,
    )
    repair = until("the bad machine in the repair queue", lambda: repair_of(rack, bad), 60, rack)
    sel = [f for f in repair["faults"] if f["witness"] == "bmc" and f["kind"] == "sel"]
    assert sel and re.search(r"(?i)uncorrectable", sel[0]["evidence"]), repair
    assert repair["source"] == "remediation" and repair["status"] == "open", repair
    assert rack.json("machines", "show", bad)["state"] == "broken"
    kinds = [e["kind"] for e in rack.json("events", "--machine", bad, "--limit", "1000")["items"]]
    for step in ("drain", "wait-jobs", "remove", "replace", "repair"):
        assert f"health.remediation.{step}" in kinds, kinds
    print(
        f"\n(a) SEL record {record_id} (uncorrectable ECC) on {bad_node}: fault -> drained "
        f"{t_drained:.1f} s; fault -> job done {t_job:.1f} s; fault -> replacement {rnode} "
        f"joined {t_joined:.1f} s; claim of 2 -> both active {t_provision:.1f} s"
    )

    # (b) The stand-in nvidia-smi, reporting XID 79, put on the agent's PATH of the node kept
    # so far: its first call writes the driver's line to the kernel log, which the agent's next
    # report carries.
    ids_b = claim_ids(rack, claim["id"])
    gpu = next(iter(ids - {bad}))
    gpu_node = kept
    install_standin(rack, tid, gpu_node, tmp_path / "gpu")
    tg = time.monotonic()
    put(rack, tid, gpu_node, "/usr/bin/nvidia-smi", '#!/bin/sh\nexec /opt/nvsmi/bin/nvidia-smi "$@"\n')  # fmt: skip
    shown = until(
        "the GPU node drained in the tenant's Slurm",
        lambda: drained(rack, tid, gpu_node),
        60,
        rack,
        every=0.25,
    )
    t_gpu_drained = time.monotonic() - tg
    assert re.search(r"Reason=metald: .*79", shown), shown
    rid_b, rnode_b = until(
        "the GPU node's replacement active and idle in the tenant's Slurm",
        lambda: replaced(rack, tid, claim["id"], gpu, ids_b),
        ACTIVE_TIMEOUT_S,
        rack,
        every=1,
    )
    t_gpu_joined = time.monotonic() - tg
    r = ctl_exec(rack, tid, "srun", "-N2", "hostname")
    assert r.returncode == 0 and sorted(r.stdout.split()) == sorted([rnode, rnode_b]), (
        r.stdout,
        r.stderr,
    )
    repair = until("the GPU node in the repair queue", lambda: repair_of(rack, gpu), 60, rack)
    xid = [f for f in repair["faults"] if f["witness"] == "node" and f["kind"] == "xid"]
    assert xid and "Xid" in xid[0]["evidence"] and "79" in xid[0]["evidence"], repair
    print(
        f"(b) stand-in nvidia-smi (XID 79) on {gpu_node}'s PATH: fault -> drained "
        f"{t_gpu_drained:.1f} s (report_interval_s 5); fault -> replacement {rnode_b} joined "
        f"{t_gpu_joined:.1f} s"
    )
    kept = rnode_b

    # (c) A node whose QEMU is paused: silent, drained and replaced after node_silence_s.
    ids2 = claim_ids(rack, claim["id"])
    quiet = rid
    quiet_node = rnode
    until("the replacement's node agent to report", lambda: reported(rack, quiet), 60, rack)
    tp = time.monotonic()
    asyncio.run(pause(lab_machine(rack, quiet)))
    until(
        "the silent node drained in the tenant's Slurm",
        lambda: drained(rack, tid, quiet_node),
        SILENCE_S + 60,
        rack,
        every=0.25,
    )
    t_silent_drained = time.monotonic() - tp
    rid2, rnode2 = until(
        "the silent node's replacement active and idle in the tenant's Slurm",
        lambda: replaced(rack, tid, claim["id"], quiet, ids2),
        ACTIVE_TIMEOUT_S,
        rack,
        every=1,
    )
    t_silent_joined = time.monotonic() - tp
    r = ctl_exec(rack, tid, "srun", "-N2", "hostname")
    assert r.returncode == 0 and sorted(r.stdout.split()) == sorted([kept, rnode2]), (
        r.stdout,
        r.stderr,
    )
    repair = until("the silent machine in the repair queue", lambda: repair_of(rack, quiet), 60,
                   rack)  # fmt: skip
    assert any(f["kind"] == "silence" for f in repair["faults"]), repair
    print(
        f"(c) QEMU of {quiet_node} paused: pause -> drained {t_silent_drained:.1f} s "
        f"(node_silence_s {SILENCE_S}); pause -> replacement {rnode2} joined "
        f"{t_silent_joined:.1f} s"
    )
