"""Elastic pools through the API and the spool handler, on both backends: CRUD and scoping,
resume -> one claim per node name (a retried request claims nothing more), a pool of 3 never
claims a 4th, suspend -> the claim released, a resumed-again name gets a fresh claim, no
machine -> the node is named down with a reason and an event."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlmodel import col, select

from api.app import CTX_KEY
from api.workflows import elastic_handler, elastic_retry
from metald.store.models import Claim, ElasticPoolRow, Event
from metald.tenants import controlplane, elastic, slurm
from metald.tenants.runtime import TenantRuntime
from tests.api_helpers import drain_steps, use_services
from tests.claims.fakes import FakeBmc
from tests.claims.helpers import DISK_SPEC, add_ready
from tests.tenants.nslab import wait_for
from tests.tenants.test_elastic_lab import star


def _elastic_claims(store, live: bool = True) -> dict[str, str]:  # type: ignore[no-untyped-def]
    with store.session() as s:
        rows = s.exec(select(Claim).where(col(Claim.idempotency_key).startswith("elastic:"))).all()
        return {
            c.idempotency_key.split(":")[2]: c.state  # type: ignore[union-attr]
            for c in rows
            if (c.state != "released") == live and c.idempotency_key.count(":") == 2  # type: ignore[union-attr]
        }


async def _pool_over(api, machines: int):  # type: ignore[no-untyped-def]
    """A disk image and a pool e[1-3] of tenant A over ``machines`` free machines labelled
    ``pool=elastic``, BMCs faked off; returns the app's context."""
    client, tokens, store = api
    ctx = client.server.app[CTX_KEY]
    use_services(ctx, bmc=FakeBmc(power_state="off"))
    r = await client.post(
        "/api/v1/images",
        json={"name": "node", "kind": "disk", **DISK_SPEC},
        headers=tokens.header("admin"),
    )
    add_ready(store, machines, labels={"pool": "elastic"})
    r = await client.post(
        f"/api/v1/tenants/{tokens.tenant_a}/elastic-pools",
        json={"name": "gpu", "prefix": "e", "max_nodes": 3, "image_id": (await r.json())["id"],
              "selector": {"labels": {"pool": "elastic"}}},
        headers=tokens.header("orchestrator"),
    )  # fmt: skip
    assert r.status == 201, await r.text()
    return ctx


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
    # Two instances act on the same request at once (one was killed -9 after claiming and a
    # survivor retries, or both drained it): one claim per name.
    first = await asyncio.gather(
        handle(tokens.tenant_a, "resume", ["e1", "e2"]),
        elastic_handler(ctx)(tokens.tenant_a, "resume", ["e2", "e1"]),
    )
    assert first == [{}, {}]
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


async def test_admin_quota_caps_resumes(api) -> None:  # type: ignore[no-untyped-def]
    """An admin caps the tenant at 2 machines at once (it holds 1 already): of e1, e2 only e1
    gets one, e2 is set down with the quota's reason. A tenant's orchestrator cannot lift its
    own cap."""
    client, tokens, store = api
    ctx = await _pool_over(api, 3)
    quota = f"/api/v1/tenants/{tokens.tenant_a}/elastic-quota"
    r = await client.put(quota, json={"max_machines": 9}, headers=tokens.header("orchestrator"))
    assert r.status == 403
    r = await client.put(quota, json={"max_machines": 2}, headers=tokens.header("admin"))
    assert r.status == 200, await r.text()
    r = await client.get(quota, headers=tokens.header("orchestrator"))
    assert (await r.json())["max_machines"] == 2
    down = await elastic_handler(ctx)(tokens.tenant_a, "resume", ["e1", "e2"])
    assert down == {"e2": elastic.REASON_QUOTA}
    assert set(_elastic_claims(store)) == {"e1"}
    await drain_steps(client)


@pytest.mark.root
@pytest.mark.lab
@pytest.mark.skipif(
    not all(shutil.which(x) for x in ("slurmctld", "sinfo", "munged")),
    reason="needs slurmctld slurm-client munge",
)
@pytest.mark.parametrize(
    "db_url", ["sqlite"], indirect=True
)  # the store side: test_pool_crud_resume_suspend
async def test_real_slurmctld_resumes_into_claims_for_exactly_those_names(
    api, db_url: str, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A real slurmctld with the pool from the store: jobs for 2, 1 and 1 nodes make it run
    ResumeProgram; the tenant runtime's drain hands the requests to the handler, which claims
    exactly e1, e2, e3 and never a 4th (the last job stays pending). The SuspendProgram slurmctld
    runs for idle nodes, here for e1 and e2 powered down by force (no slurmd: they never get
    idle), releases exactly those claims."""
    client, tokens, store = api
    async with _real_pool(api, tmp_path, machines=5) as (cp, runtime, _nodes):

        def claims_are(want: set[str]):  # type: ignore[no-untyped-def]
            return lambda: set(_elastic_claims(store)) == want

        jobs = [sbatch(cp, n) for n in ("-N2", "-N1", "-N1")]
        assert await _drain_until(runtime, claims_are({"e1", "e2", "e3"})), _elastic_claims(store)
        await runtime._drain_elastic()
        assert set(_elastic_claims(store)) == {"e1", "e2", "e3"}
        st = cp.run("squeue", "-h", "-j", jobs[2], "-o", "%T").stdout.strip()
        assert st == "PENDING", st
        assert cp.elastic_requests() == []

        # slurmctld runs SuspendProgram itself once the power-up is cancelled (a node it
        # still powered up would be resumed again: it must hold a claim).
        r = cp.run("scontrol", "update", "nodename=e1,e2", "state=power_down_force")
        assert r.returncode == 0, r.stderr
        assert await _drain_until(runtime, claims_are({"e3"})), _elastic_claims(store)
        assert _elastic_claims(store, live=False) == {"e1": "released", "e2": "released"}


@contextlib.asynccontextmanager
async def _real_pool(
    api, tmp_path: Path, machines: int, nodes: int = 1
) -> AsyncIterator[tuple[controlplane.SlurmControlPlane, TenantRuntime, list[str]]]:  # type: ignore[no-untyped-def]
    """A pool e[1-3] over ``machines`` free machines, a real slurmctld with it, and the tenant
    runtime's drain wired to the handler and the retry as the daemon wires them."""
    client, tokens, store = api
    ctx = await _pool_over(api, machines)
    with store.session() as s:
        pools = [elastic.pool_of(p) for p in s.exec(select(ElasticPoolRow))]
    runtime = TenantRuntime(store, ctx.secrets, ctx.cfg.tenants, str(tmp_path), "test")
    runtime.elastic_handler = elastic_handler(ctx)
    runtime.elastic_retry = elastic_retry(ctx)
    with star(nodes) as (hub, node_ns):
        cp = controlplane.SlurmControlPlane(
            tenant_id=tokens.tenant_a, tenant_name=f"el{secrets.token_hex(2)}", ns=hub,
            workdir=tmp_path / "ctl", hub_address="10.97.1.1",
            munge_key=slurm.generate_munge_key(), pools=pools,
        )  # fmt: skip
        runtime.running[tokens.tenant_a] = SimpleNamespace(  # type: ignore[assignment]
            control=cp, spec=SimpleNamespace(tenant_name="acme")
        )
        try:
            cp.start()
            assert wait_for(lambda: set(cp.nodes() or {}) == {"e1", "e2", "e3"}, 15)
            yield cp, runtime, node_ns
        finally:
            cp.stop()
            await drain_steps(client)


async def _drain_until(runtime: TenantRuntime, cond, timeout: float = 20) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await runtime._drain_elastic()
        if cond():
            return True
        await asyncio.sleep(0.2)
    return False


@pytest.mark.root
@pytest.mark.lab
@pytest.mark.skipif(
    not all(shutil.which(x) for x in ("slurmctld", "sinfo", "munged")),
    reason="needs slurmctld slurm-client munge",
)
@pytest.mark.parametrize(
    "db_url", ["sqlite"], indirect=True
)  # the store side: test_pool_crud_resume_suspend
async def test_real_slurmctld_node_down_for_want_of_a_machine_is_retried_when_one_frees(
    api, db_url: str, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """One machine for a 2-node job: e1 gets it, e2 is set down with the reason. While no
    machine is free the drain leaves e2 down (no claim, no second event); once one is, the
    drain claims it for e2 and returns e2 to service: slurmctld powers it up again (``idle#``,
    waiting for the machine to register), its reason gone, an ``elastic.retry`` event."""
    _client, _tokens, store = api
    async with _real_pool(api, tmp_path, machines=1) as (cp, runtime, _ns):
        sbatch(cp, "-N2")
        states = cp.node_states

        def e2_down() -> bool:
            st = (states() or {}).get("e2")
            return st is not None and st.base == "down"

        assert await _drain_until(
            runtime, lambda: set(_elastic_claims(store)) == {"e1"} and e2_down()
        )
        st = (states() or {})["e2"]
        assert st.reason == elastic.REASON_NO_MACHINE and st.powering_up, st
        for _ in range(3):  # nothing free: nothing claimed, no event per pass
            await runtime._drain_elastic()
        assert set(_elastic_claims(store)) == {"e1"} and e2_down()
        with store.session() as s:
            assert len(s.exec(select(Event).where(Event.kind == "elastic.no-machine")).all()) == 1

        add_ready(store, 1, labels={"pool": "elastic"}, prefix="freed")
        assert await _drain_until(runtime, lambda: set(_elastic_claims(store)) == {"e1", "e2"})
        st = (states() or {})["e2"]
        assert st.base != "down" and st.powering_up and st.reason == "", st
        with store.session() as s:
            (ev,) = s.exec(select(Event).where(Event.kind == "elastic.retry")).all()
            assert ev.data == {"nodes": ["e2"]}


@pytest.mark.root
@pytest.mark.lab
@pytest.mark.skipif(
    not all(shutil.which(x) for x in ("slurmctld", "sinfo", "munged")),
    reason="needs slurmctld slurm-client munge",
)
@pytest.mark.parametrize(
    "db_url", ["sqlite"], indirect=True
)  # the store side: test_pool_crud_resume_suspend
async def test_real_slurmctld_resume_whose_request_was_lost_is_claimed_from_node_states(
    api, db_url: str, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The instance that ran the hub was killed after slurmctld ran ResumeProgram and before
    it acted: the request was in that host's spool, which the survivor does not have (here:
    removed). The drain still claims exactly e1 and e2, from slurmctld's node states (powering
    up, no claim); draining again claims nothing more."""
    _client, _tokens, store = api
    async with _real_pool(api, tmp_path, machines=3) as (cp, runtime, _ns):
        sbatch(cp, "-N2")
        assert wait_for(lambda: bool(cp.elastic_requests()), 15)
        for path in cp.elastic_requests():
            path.unlink()
        assert await _drain_until(runtime, lambda: set(_elastic_claims(store)) == {"e1", "e2"})
        for _ in range(3):
            await runtime._drain_elastic()
        assert set(_elastic_claims(store)) == {"e1", "e2"}
        with store.session() as s:
            assert (
                len(
                    s.exec(
                        select(Claim).where(col(Claim.idempotency_key).startswith("elastic:"))
                    ).all()
                )
                == 2
            )


@pytest.mark.root
@pytest.mark.lab
@pytest.mark.skipif(
    not all(shutil.which(x) for x in ("slurmctld", "slurmd", "sinfo", "munged")),
    reason="needs slurmctld slurmd slurm-client munge",
)
@pytest.mark.skipif(
    os.environ.get("METALD_LAB_LONG") != "1",
    reason="~3 min (slurmctld holds a requeued job back 2 minutes): METALD_LAB_LONG=1",
)
@pytest.mark.parametrize(
    "db_url", ["sqlite"], indirect=True
)  # the store side: test_pool_crud_resume_suspend
async def test_real_slurmctld_retried_node_joins_and_the_job_runs(
    api, db_url: str, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Long: the retry end to end with real slurmds (a namespace each, standing in for the
    provisioned machines): one machine for a 2-node job, e2 set down; a machine frees, the
    drain claims it for e2 and returns e2 to service; slurmds join as e1 and e2 and the job,
    requeued when e2 went down, completes on e1 and e2."""
    _client, _tokens, store = api
    procs: list[subprocess.Popen[bytes]] = []
    async with _real_pool(api, tmp_path, machines=1, nodes=2) as (cp, runtime, node_ns):
        try:
            t0 = time.monotonic()
            job = sbatch(cp, "-N2")
            states = cp.node_states
            assert await _drain_until(
                runtime, lambda: (states() or {}).get("e2", elastic.NodeState("")).base == "down"
            )
            add_ready(store, 1, labels={"pool": "elastic"}, prefix="freed")
            assert await _drain_until(runtime, lambda: set(_elastic_claims(store)) == {"e1", "e2"})
            t_retry = time.monotonic() - t0
            for name, ns in zip(["e1", "e2"], node_ns, strict=True):
                m = slurm.cloud_join_material(
                    hub_address="10.97.1.1", munge_key=cp.munge_key, node_name=name
                )
                procs.append(
                    controlplane.start_machine(
                        ns,
                        name,
                        tmp_path / name,
                        base64.b64decode(m["munge_key"]),
                        "slurmd",
                        "-D",
                        "-b",
                        *m["slurmd_args"],
                    )  # fmt: skip
                )

            def done() -> bool:
                out = cp.run("scontrol", "show", "job", job).stdout
                return "JobState=COMPLETED" in out

            assert await _drain_until(runtime, done, timeout=300), (
                cp.run("scontrol", "show", "job", job).stdout,
                cp.node_states(),
            )
            nodelist = cp.run("squeue", "-h", "-t", "all", "-j", job, "-o", "%N").stdout.strip()
            assert nodelist == "e[1-2]", nodelist
            assert set(_elastic_claims(store)) == {"e1", "e2"}
            print(
                f"\nelastic retry: sbatch -> e2 down and retried with a freed machine "
                f"{t_retry:.1f} s; sbatch -> COMPLETED {time.monotonic() - t0:.1f} s "
                f"(the requeued job waits slurmctld's 2 min); load {os.getloadavg()}"
            )
        finally:
            for p in procs:
                controlplane.stop_process(p)


def sbatch(cp: controlplane.SlurmControlPlane, nodes: str) -> str:
    r = cp.run("sbatch", "-p", "elastic_gpu", "--parsable", nodes, "--wrap", "true")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()
