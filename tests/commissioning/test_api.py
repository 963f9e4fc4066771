"""Commissioning through the API on both backends: an enroll rule's profile sends a freshly
inventoried machine to commissioning; the agent's reports are judged by metald; the machine
ends ready or commission-failed with a sentence; a technician retries after a repair."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlmodel import select

from api.app import CTX_KEY
from metald.commissioning.profile import CheckSpec, CommissioningProfile, DiskSpec
from metald.config import EnrollConfig
from metald.inventory.rules import EnrollmentRule
from metald.lifecycle import State
from metald.provision import watchdog
from metald.store.models import CommissioningRun, Event, Machine, utcnow
from tests.test_enrollment import enrolled_via_hooks, payload

FIX = Path(__file__).parent / "fixtures"
SMART_OK = (FIX / "smartctl-j_nvme-intel-ssdpeknw010t8_pass.json").read_text()
SMART_MEDIA_ERRORS = (FIX / "smartctl-x-j_nvme-samsung-970evo_media-errors.json").read_text()
FIO_OK = json.dumps({"jobs": [{"jobname": "read", "error": 0, "read": {"bw": 512000}}]})


def profile(min_disk_gb: float = 3000) -> CommissioningProfile:
    return CommissioningProfile(
        name="xe9680-h100",
        gpu_model="*H100*",
        gpu_count=8,
        min_memory_gb=1900,
        disks=[DiskSpec(min_size_gb=min_disk_gb)],
        checks=[CheckSpec(name="smart", timeout_s=60), CheckSpec(name="fio", timeout_s=120)],
    )


async def _inventoried(client: Any, store: Any, prof: CommissioningProfile) -> tuple[Any, dict]:
    ctx = client.server.app[CTX_KEY]
    ctx.cfg.enroll = EnrollConfig(
        rules=[EnrollmentRule(match={"gpu_model": "*H100*"}, commissioning=prof)]
    )
    hooks, target = await enrolled_via_hooks(store)
    agent = {"Authorization": f"Bearer {target.kernel_args['metald.token']}"}
    r = await client.post(
        "/api/v1/agent/inventory",
        json=payload(target.machine_id, boot_id=str(uuid.uuid4())),
        headers=agent,
    )
    assert r.status == 200, await r.text()
    return target, agent


def report(name: str, raw: str, outcome: str = "ran", exit_code: int = 0) -> dict:
    return {"name": name, "outcome": outcome, "exit_code": exit_code, "duration_s": 1.5, "raw": raw}


async def test_profile_commissions_then_ready(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    target, agent = await _inventoried(client, store, profile())
    mid = target.machine_id
    r = await client.get("/api/v1/agent/next", headers=agent)
    assert (await r.json())["action"] == "commission"
    r = await client.get("/api/v1/agent/commissioning", headers=agent)
    plan = await r.json()
    assert [c["name"] for c in plan["checks"]] == ["smart", "fio"]
    assert plan["checks"][0]["timeout_s"] == 60
    r = await client.post(
        "/api/v1/agent/commissioning",
        json={"results": [report("smart", SMART_OK)]},
        headers=agent,
    )
    assert (await r.json())["state"] == "commissioning"
    r = await client.post(
        "/api/v1/agent/commissioning", json={"results": [report("fio", FIO_OK)]}, headers=agent
    )
    body = await r.json()
    assert (body["status"], body["state"]) == ("passed", "ready")
    r = await client.get(
        f"/api/v1/machines/{mid}/commissioning", headers=tokens.header("technician")
    )
    out = await r.json()
    assert r.status == 200, out
    last = out["last"]
    assert (last["profile"], last["status"]) == ("xe9680-h100", "passed")
    checks = {x["check"]: x for x in last["results"]}
    assert set(checks) == {"sku", "smart", "fio"}
    assert checks["fio"]["values"]["jobs"][0]["read_mbps"] == 524.3
    assert checks["smart"]["raw"] == SMART_OK and checks["smart"]["agent_status"] == "ran"
    with store.session() as s:
        kinds = [e.kind for e in s.exec(select(Event).where(Event.machine_id == mid))]
    assert kinds.count("commissioning.check.passed") == 3


async def test_disk_smaller_than_profile_fails_at_once_naming_it(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    target, agent = await _inventoried(client, store, profile(min_disk_gb=8000))
    with store.session() as s:
        m = s.get(Machine, target.machine_id)
        assert m.state == "commission-failed"  # type: ignore[union-attr]
        assert m.last_error == (  # type: ignore[union-attr]
            "commissioning failed: sku: expected 1 disk(s) of 8000 GB or more, "
            "found 0 (nvme0n1 3840.8 GB)"
        )
    # Nothing left to report: the run is over.
    r = await client.post(
        "/api/v1/agent/commissioning", json={"results": [report("smart", SMART_OK)]}, headers=agent
    )
    assert r.status == 409


async def test_agent_verdict_is_not_trusted_and_retry_after_repair(api) -> None:  # type: ignore[no-untyped-def]
    """The agent says it ran smartctl fine (exit 0); the output holds media errors: failed.
    A technician then asks again; the machine is inspected and commissioned anew."""
    client, tokens, store = api
    target, agent = await _inventoried(client, store, profile())
    mid = target.machine_id
    r = await client.post(
        "/api/v1/agent/commissioning",
        json={"results": [report("smart", SMART_MEDIA_ERRORS)], "done": True},
        headers=agent,
    )
    body = await r.json()
    assert (body["status"], body["state"]) == ("failed", "commission-failed"), body
    r = await client.get(f"/api/v1/machines/{mid}/commissioning", headers=tokens.header("admin"))
    last = (await r.json())["last"]
    assert last["summary"] == (
        "smart: /dev/nvme0 has 7 NVMe media errors; fio: fio was never reported by the agent"
    )
    # The technician swaps the disk and asks again: the machine boots discovery once more.
    tech = tokens.header("technician")
    r = await client.post(
        f"/api/v1/machines/{mid}/commission", json={"reason": "disk swapped"}, headers=tech
    )
    assert r.status == 202, await r.text()
    assert (await r.json())["last"]["status"] == "requested"
    hooks, target2 = await enrolled_via_hooks(store)
    agent2 = {"Authorization": f"Bearer {target2.kernel_args['metald.token']}"}
    r = await client.post(
        "/api/v1/agent/inventory",
        json=payload(mid, boot_id=str(uuid.uuid4())),
        headers=agent2,
    )
    assert (await r.json())["state"] == "commissioning"
    # The first boot's token is of an earlier boot: refused.
    r = await client.get("/api/v1/agent/commissioning", headers=agent)
    assert r.status in (401, 409)
    r = await client.post(
        "/api/v1/agent/commissioning",
        json={"results": [report("smart", SMART_OK), report("fio", FIO_OK)]},
        headers=agent2,
    )
    assert (await r.json())["state"] == "ready"
    r = await client.get(f"/api/v1/machines/{mid}/commissioning", headers=tech)
    out = await r.json()
    assert out["last"]["status"] == "passed" and out["history"][0]["status"] == "failed"
    assert out["last"]["results"][1]["raw"] == SMART_OK
    assert all(r["raw"] is None for r in out["history"][0]["results"])  # history stays small


async def test_bad_reports_change_nothing(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    target, agent = await _inventoried(client, store, profile())
    r = await client.post(
        "/api/v1/agent/commissioning", json={"results": [report("dcgm", "{}")]}, headers=agent
    )
    assert r.status == 422 and "not in this run's plan" in (await r.json())["detail"]
    r = await client.post(
        "/api/v1/agent/commissioning",
        json={"results": [report("smart", SMART_OK, outcome="timeout")]},
        headers=agent,
    )
    assert r.status == 200
    r = await client.post(
        "/api/v1/agent/commissioning", json={"results": [report("smart", SMART_OK)]}, headers=agent
    )
    assert r.status == 409 and "already reported" in (await r.json())["detail"]
    r = await client.post(
        "/api/v1/agent/commissioning", json={"results": [report("fio", FIO_OK)]}, headers=agent
    )
    last = await (
        await client.get(
            f"/api/v1/machines/{target.machine_id}/commissioning", headers=tokens.header("admin")
        )
    ).json()
    assert last["last"]["summary"] == "smart: smart did not finish within 60 s"
    assert last["state"] == "commission-failed"
    # Another role cannot post results; a technician cannot commission a machine of a tenant.
    r = await client.post(
        "/api/v1/agent/commissioning", json={"results": []}, headers=tokens.header("technician")
    )
    assert r.status == 403
    r = await client.post(
        f"/api/v1/machines/{tokens.machine_a}/commission", json={}, headers=tokens.header("admin")
    )
    assert r.status == 409


async def test_watchdog_fails_a_hung_commissioning(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    target, _agent = await _inventoried(client, store, profile())
    with store.session() as s:
        moved = watchdog.sweep(
            s, {State.COMMISSIONING: 60}, actor="t", now=utcnow() + timedelta(seconds=61)
        )
        assert moved == [target.machine_id]
        assert s.get(Machine, target.machine_id).state == "commission-failed"  # type: ignore[union-attr]


async def test_a_profile_on_release_commissions_again_after_the_wipe(api) -> None:  # type: ignore[no-untyped-def]
    """The wipe is verified and, in the same transaction, the machine is sent back to
    inspection with a requested run: no claim ever sees it ready in between."""
    from metald import machines
    from metald.lifecycle import Trigger
    from metald.provision import commissioning
    from metald.provision.progress import Progress, record_progress

    client, tokens, store = api
    prof = profile().model_copy(update={"on_release": True})
    target, agent = await _inventoried(client, store, prof)
    mid = target.machine_id
    await client.post(
        "/api/v1/agent/commissioning",
        json={"results": [report("smart", SMART_OK), report("fio", FIO_OK)]},
        headers=agent,
    )
    size, mib = 3840755982336, 1 << 20
    evidence = [
        {
            "device": "/dev/nvme0n1",
            "size_bytes": size,
            "method": "zero-ends",
            "reads": [
                {"offset": 0, "length": mib, "zero": True},
                {"offset": size - mib, "length": mib, "zero": True},
            ],
        }
    ]
    rules = client.server.app[CTX_KEY].cfg.enroll.rules
    with store.session() as s:
        machines.transition(s, mid, Trigger.MAINTENANCE_ON, actor="t")
        m = machines.transition(s, mid, Trigger.WIPE, actor="t")
        m = record_progress(
            s,
            mid,
            Progress(phase="wipe", done=True, disks=evidence),
            actor="agent",
            token_boot=m.boot_current,
            on_wiped=lambda s, m: commissioning.after_wipe(s, m, rules, actor="agent"),
        )
        assert m.state == "inspecting"
        states = [
            e.to_state
            for e in s.exec(
                select(Event).where(Event.machine_id == mid, Event.kind == "machine.state")
            )
        ]
        assert states[-2:] == ["ready", "inspecting"]
        runs = s.exec(select(CommissioningRun).where(CommissioningRun.machine_id == mid)).all()
        assert sorted(r.status for r in runs) == ["passed", "requested"]
