"""POST /api/v1/health/report on both backends: only a node token, the witness is the node
whatever the body says, bounded bodies, 429 with Retry-After for a node reporting too often,
problem+json errors, and the faults and events it records."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from sqlmodel import col, select

from api.app import CTX_KEY
from metald.health.config import HealthConfig, PolicyConfig
from metald.health.remediation import Step
from metald.healthwatch.watch import HealthWatch
from metald.provision.metadata import hostname
from metald.store.models import Event, HealthFault, Machine, NodeHeartbeat
from tests.healthwatch.helpers import FakeScheduler, bmc_fault, rem_rows, workflow
from tests.tenants.test_mesh import _claim, _hubs, _join

XID79 = "[12345.678] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n"
ECC = Path(__file__).parent / "fixtures" / "nvidia-smi-q-x_a100_derived_uncorrectable-ecc.xml"


def _health(client: Any, **kw: Any) -> None:
    ctx = client.app[CTX_KEY]
    ctx.cfg = ctx.cfg.model_copy(update={"health": HealthConfig(**kw)})


async def _node(client: Any, tokens: Any, store: Any) -> tuple[str, str, str]:
    await _hubs(client, tokens)
    claim_id, (mid,) = await _claim(client, tokens, store, 1)
    j = await _join(client, tokens.header("orchestrator"), mid, store)
    return claim_id, mid, j["mesh"]["node_token"]


async def _report(client: Any, token: str | None, body: dict[str, Any]) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return await client.post("/api/v1/health/report", json=body, headers=headers)


async def test_a_node_report_opens_faults_witnessed_by_the_node(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    _health(client, report_min_interval_s=0)
    claim_id, mid, token = await _node(client, tokens, store)
    r = await _report(client, token, {"version": 1, "kernel_log": XID79})
    assert r.status == 200, await r.text()
    out = await r.json()
    assert out["interval_s"] == 15 and out["new_faults"] == 1
    with store.session() as s:
        (f,) = s.exec(select(HealthFault).where(HealthFault.machine_id == mid)).all()
        assert (f.witness, f.kind, f.severity, f.rule) == ("node", "xid", "fatal", "xid-fatal")
        assert "GPU has fallen off the bus" in f.evidence
        assert s.get(NodeHeartbeat, mid).reports == 1
        ev = s.exec(select(Event).where(Event.kind == "health.fault")).one()
        assert ev.machine_id == mid and ev.data["claim_id"] == claim_id
        assert ev.tenant_id == tokens.tenant_a  # on the tenant's (the claim's) stream
    # The same line again: the same fault, seen twice, not a second one.
    r = await _report(client, token, {"kernel_log": XID79})
    assert r.status == 200 and (await r.json())["new_faults"] == 0
    with store.session() as s:
        (f,) = s.exec(select(HealthFault).where(HealthFault.machine_id == mid)).all()
        assert f.count == 2


async def test_a_forged_witness_or_verdict_is_refused(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    _health(client, report_min_interval_s=0)
    _, mid, token = await _node(client, tokens, store)
    for forged in ({"witness": "bmc"}, {"severity": "ok"}, {"healthy": True}, {"version": 2}):
        r = await _report(client, token, {"kernel_log": XID79, **forged})
        assert r.status == 422, forged
        assert r.content_type == "application/problem+json"
    # The ECC capture: the node's word, never the BMC's.
    r = await _report(client, token, {"kernel_log": "", "nvidia_smi_xml": ECC.read_text()})
    assert r.status == 200, await r.text()
    with store.session() as s:
        rows = s.exec(select(HealthFault).where(HealthFault.machine_id == mid)).all()
        assert rows and {f.witness for f in rows} == {"node"}


async def test_only_a_node_token_reports(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    _, _, token = await _node(client, tokens, store)
    r = await _report(client, None, {"kernel_log": XID79})
    assert r.status == 401 and r.content_type == "application/problem+json"
    for role in ("admin", "orchestrator", "technician"):
        r = await client.post(
            "/api/v1/health/report", json={"kernel_log": XID79}, headers=tokens.header(role)
        )
        assert r.status == 401, role
    r = await _report(client, "mnt_" + "x" * 40, {"kernel_log": XID79})
    assert r.status == 401
    assert "unknown or revoked" in (await r.json())["detail"]


async def test_bounded_body(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    _, _, token = await _node(client, tokens, store)
    r = await _report(client, token, {"kernel_log": "x" * (128 * 1024 + 1)})
    assert r.status == 422
    r = await client.post(
        "/api/v1/health/report",
        data=b'{"kernel_log": "' + b"x" * 1_300_000 + b'"}',
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    assert r.status == 413 and r.content_type == "application/problem+json"


async def test_a_node_reporting_too_often_gets_429_with_retry_after(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    _health(client, report_min_interval_s=30)
    _, mid, token = await _node(client, tokens, store)
    assert (await _report(client, token, {"kernel_log": ""})).status == 200
    r = await _report(client, token, {"kernel_log": XID79})
    assert r.status == 429
    assert 1 <= int(r.headers["Retry-After"]) <= 30
    assert "report at most every 30 s" in (await r.json())["detail"]
    with store.session() as s:  # nothing of the refused report was recorded
        assert s.get(NodeHeartbeat, mid).reports == 1
        assert not s.exec(select(HealthFault).where(col(HealthFault.machine_id) == mid)).all()


async def test_a_report_wakes_the_running_watch_which_drains_the_node(api) -> None:  # type: ignore[no-untyped-def]
    """The route and the ``health`` service together: no interval to wait for (the watch's
    is an hour here), the report's fault is drained at once; prints report -> drained."""
    client, tokens, store = api
    _health(client, report_min_interval_s=0, watch_interval_s=3600)
    ctx = client.app[CTX_KEY]
    cfg = ctx.cfg.health
    sched = FakeScheduler()
    watch = HealthWatch(store, cfg, "i1", remediations=workflow(store, sched, cfg),
                        table=cfg.table(), scheduler_for=lambda _t: sched)  # fmt: skip
    await watch.start()
    try:
        await asyncio.sleep(0)  # its first round (nothing to do) runs now
        ctx.services = ctx.services.__class__(health_watch=watch)
        _, mid, token = await _node(client, tokens, store)
        with store.session() as s:
            m = s.get(Machine, mid)
            node = hostname(m.id, m.name)
        sched.jobs[node] = ["1"]  # a job runs on: the remediation stops at wait-jobs
        t0 = time.monotonic()
        r = await _report(client, token, {"kernel_log": XID79})
        assert r.status == 200
        deadline = time.monotonic() + 10
        while node not in sched.drained:
            assert time.monotonic() < deadline, rem_rows(store)
            await asyncio.sleep(0.01)
        print(f"node report posted -> drained (through the API and the woken watch): "
              f"{(time.monotonic() - t0) * 1000:.0f} ms")  # fmt: skip
        assert sched.drained[node] == f"metald: {XID79.strip()}"
        (row,) = rem_rows(store)
        assert row.step in (Step.DRAIN, Step.WAIT_JOBS)
        # The tenant's orchestrator sees every action on its stream, with the claim and why.
        for role, sees in (("orchestrator", True), ("orchestrator_other", False)):
            r = await client.get("/api/v1/events?limit=200", headers=tokens.header(role))
            assert r.status == 200
            got = {e["kind"]: e for e in (await r.json())["items"]}
            assert ("health.remediation.drain" in got) is sees, role
        r = await client.get("/api/v1/events?limit=200", headers=tokens.header("orchestrator"))
        got_a = {e["kind"]: e for e in (await r.json())["items"]}
        drain = got_a["health.remediation.drain"]
        assert drain["data"]["claim_id"] == row.claim_id and "draining node" in drain["reason"]
        assert got_a["health.fault"]["data"]["witness"] == "node"
    finally:
        await watch.stop()


A100_CLEAN = (
    Path(__file__).parents[1]
    / "fixtures"
    / "gpu"
    / "nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml"
)


async def test_a_healthy_report_does_not_save_a_node_its_bmc_condemns(api) -> None:  # type: ignore[no-untyped-def]
    """The trust rule end to end: the BMC logs an uncorrectable ECC record (recorded as the
    watch records it), then the node, root in the tenant's hands, reports itself healthy
    through the real route again and again (a clean nvidia-smi capture, an empty kernel log).
    The BMC's fault stays open and fatal, and the workflow still drains the node in the
    tenant's scheduler and takes it out of the claim."""
    client, tokens, store = api
    _health(client, report_min_interval_s=0, policy=PolicyConfig(job_wait_s=0))
    cfg = client.app[CTX_KEY].cfg.health
    claim_id, mid, token = await _node(client, tokens, store)
    with store.session() as s:  # the machine holds the capture's one GPU
        m = s.get(Machine, mid)
        m.gpu_count = 1
        s.add(m)
        s.commit()
    assert bmc_fault(store, mid, cfg) == 1
    healthy = {"kernel_log": "", "nvidia_smi_xml": A100_CLEAN.read_text()}
    for _ in range(3):
        r = await _report(client, token, healthy)
        assert r.status == 200, await r.text()
        assert (await r.json())["new_faults"] == 0, _faults(store)
    with store.session() as s:
        (f,) = s.exec(select(HealthFault).where(HealthFault.machine_id == mid)).all()
        assert (f.witness, f.severity, f.cleared_at, f.open_key is not None) == (
            "bmc", "fatal", None, True,
        )  # fmt: skip
        assert s.get(NodeHeartbeat, mid).reports == 3
    sched = FakeScheduler()
    await workflow(store, sched, cfg).run_all()
    with store.session() as s:
        m = s.get(Machine, mid)
        node = hostname(m.id, m.name)
        assert m.claim_id is None  # out of the claim despite three healthy reports
    assert "Uncorrectable ECC" in sched.drained[node]
    assert ("remove", node) in sched.calls
    (row,) = rem_rows(store)
    assert row.severity == "fatal" and row.claim_id == claim_id


def _faults(store: Any) -> list[tuple[str, str, str, str]]:
    with store.session() as s:
        return [(f.witness, f.kind, f.code, f.evidence) for f in s.exec(select(HealthFault))]


async def test_a_correctable_ecc_storm_across_reports_is_degraded(api) -> None:  # type: ignore[no-untyped-def]
    """The count of one report is no storm; the rise between two reports within
    ``ecc_window_s`` over ``correctable_ecc_per_hour`` is (the readings kept on the heartbeat
    row, migration 0031)."""
    client, tokens, store = api
    _health(client, report_min_interval_s=0, ecc_window_s=3600, correctable_ecc_per_hour=1000)
    _, mid, token = await _node(client, tokens, store)
    with store.session() as s:  # the machine holds the capture's one GPU
        m = s.get(Machine, mid)
        m.gpu_count = 1
        s.add(m)
        s.commit()
    xml = A100_CLEAN.read_text()
    agg = "<aggregate>\n                <sram_correctable>0</sram_correctable>\n"
    agg += "                <sram_uncorrectable>0</sram_uncorrectable>\n"
    agg += "                <dram_correctable>{n}</dram_correctable>"
    assert agg.format(n=0) in xml

    async def report(n: int) -> dict[str, Any]:
        body = {"kernel_log": "", "nvidia_smi_xml": xml.replace(agg.format(n=0), agg.format(n=n))}
        r = await _report(client, token, body)
        assert r.status == 200, await r.text()
        return await r.json()  # type: ignore[no-any-return]

    assert (await report(10))["new_faults"] == 0  # one reading: no rate
    assert (await report(500))["new_faults"] == 0  # 490 in the window: under 1,000/h
    with store.session() as s:
        kept = s.get(NodeHeartbeat, mid).ecc_readings
        assert [v for _, v in next(iter(kept.values()))] == [10, 500]
    assert (await report(4010))["new_faults"] == 1  # 4,000 in the window: a storm
    with store.session() as s:
        (f,) = s.exec(select(HealthFault).where(HealthFault.machine_id == mid)).all()
        assert (f.witness, f.code, f.severity, f.rule) == (
            "node", "correctable-rate", "degraded", "gpu-ecc-correctable-storm",
        )  # fmt: skip
        assert "rose by 4000" in f.evidence
