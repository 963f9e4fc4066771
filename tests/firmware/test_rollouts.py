"""Firmware rollouts over the API (issue 27, item 3), through lab Redfish BMCs in front of real
QEMUs: waves, a failure budget of 1 tripped by an injected failure (the rollout stops, the
machines after it untouched, the events say why), pause / resume / abort, a rollout taken over
by a survivor once its driver's lease ran out, and roles (admins write, technicians read)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select

from metald import machines
from metald.firmware.rollouts import FirmwareRollouts
from metald.inventory.normalize import NormalizedInventory
from metald.lifecycle import Trigger
from metald.store.models import Event, FirmwareRollout, FirmwareUpdate, Machine
from tests.bmc.peers import LabRedfish, start_lab_redfish
from tests.firmware.lab import Env, _image
from vmlab.redfish_update import UPDATES, make_image

N = 3


@pytest.fixture
async def bmcs(tmp_path: Path) -> AsyncIterator[list[LabRedfish]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(start_lab_redfish(tmp_path, i)) for i in range(N)]


def _rollouts(e: Env, instance: str | None = None, lease_s: float = 30) -> FirmwareRollouts:
    ro = FirmwareRollouts(e.store, e.fw, instance or e.cfg.instance, tick_s=0.05, lease_s=lease_s)
    e.fw.on_end = ro.wake
    return ro


async def _machines(e: Env, peers: list[LabRedfish], *, bios: str = "2023.05") -> list[str]:
    """N ready H100 machines (rk-a, rk-b, ...), each with its lab BMC linked and versions
    read, and the profile's baseline asking for BIOS ``bios``."""
    t, c = e.tokens, e.client
    ids = []
    with e.store.session() as s:
        for i in range(N):
            m = machines.create_machine(
                s, macs=[f"52:54:00:10:00:{i:02x}"], actor="test", name=f"rk-{'abc'[i]}"
            )
            machines.transition(s, m.id, Trigger.INSPECT, actor="test")
            inv = NormalizedInventory(gpu_model="NVIDIA H100 80GB HBM3", gpu_count=8)
            machines.transition(s, m.id, Trigger.INSPECTED, actor="test",
                                updates={"inventory": {"normalized": inv.model_dump(mode="json")},
                                         "gpu_model": inv.gpu_model, "gpu_count": 8})  # fmt: skip
            ids.append(m.id)
    for mid, peer in zip(ids, peers, strict=True):
        body = {"address": "http://127.0.0.1", "port": peer.port, "protocol": "redfish",
                "username": peer.username, "password": peer.password, "machine_id": mid}  # fmt: skip
        r = await c.post("/api/v1/bmcs", json=body, headers=t.header("technician"))
        assert r.status == 201, await r.text()
        r = await c.get(f"/api/v1/machines/{mid}/firmware", headers=t.header("technician"))
        assert r.status == 200, await r.text()
    url, sha = _image(e, "bios.bin", make_image("BIOS", bios))
    comp = {"id": "BIOS", "version": bios, "url": url, "sha256": sha, "apply": "host-reset"}
    r = await c.put("/api/v1/firmware/baselines/h100-8x", json={"components": [comp]},
                    headers=t.header("admin"))  # fmt: skip
    assert r.status == 200, await r.text()
    return ids


async def _create(e: Env, **kw: Any) -> dict[str, Any]:
    body = {"profile": "h100-8x", "version": 1, "selector": {"gpu_model": "NVIDIA H100*"},
            "batch_size": 1, "max_unavailable": 1, "failure_budget": 1, **kw}  # fmt: skip
    r = await e.client.post(
        "/api/v1/firmware/rollouts", json=body, headers=e.tokens.header("admin")
    )
    assert r.status == 202, await r.text()
    out: dict[str, Any] = await r.json()
    return out


async def _get(e: Env, rid: str) -> dict[str, Any]:
    r = await e.client.get(
        f"/api/v1/firmware/rollouts/{rid}", headers=e.tokens.header("technician")
    )
    assert r.status == 200, await r.text()
    out: dict[str, Any] = await r.json()
    return out


async def _until(e: Env, rid: str, pred: Any, limit_s: float = 60) -> dict[str, Any]:
    end = time.monotonic() + limit_s
    while True:
        got = await _get(e, rid)
        if pred(got):
            return got
        assert time.monotonic() < end, got
        await asyncio.sleep(0.05)


def _status(ro: dict[str, Any]) -> dict[str, str]:
    return {t["machine_id"]: t["status"] for t in ro["targets"]}


async def test_budget_of_one_stops_the_rollout(env: Env, bmcs: list[LabRedfish]) -> None:
    e = env
    ids = await _machines(e, bmcs)
    # Only the three lab machines: the seeded ones have no BMC and no H100-8x profile match.
    bmcs[1].app[UPDATES].faults.add("checksum")  # the second machine's BMC fails its flash
    ro = _rollouts(e)
    await ro.start()
    try:
        created = await _create(e)
        rid = created["id"]
        assert [t["machine_id"] for t in created["targets"]] == ids
        done = await _until(e, rid, lambda r: r["finished_at"] is not None)
    finally:
        await ro.stop()
    assert done["state"] == "stopped", done
    assert "failure budget of 1" in done["reason"] and ids[1] in done["reason"], done
    assert _status(done) == {ids[0]: "done", ids[1]: "failed", ids[2]: "pending"}
    assert done["progress"]["done"] == 1 and done["progress"]["failed"] == 1
    with e.store.session() as s:
        states = {m.id: m.state for m in s.exec(select(Machine)).all()}
        # Updated and back in the pool; failed and held for a person; untouched.
        assert (states[ids[0]], states[ids[1]], states[ids[2]]) == (
            "ready",
            "maintenance",
            "ready",
        )
        assert not s.exec(select(FirmwareUpdate).where(FirmwareUpdate.machine_id == ids[2])).all()
        kinds = [ev.kind for ev in s.exec(select(Event).order_by(Event.id)).all()]  # type: ignore[arg-type]
        stop = s.exec(select(Event).where(Event.kind == "firmware.rollout-stopped")).one()
        assert "failure budget" in (stop.reason or "")
        assert stop.data["progress"]["failed"] == 1
    assert "firmware.rollout-machine" in kinds
    # The third BMC never saw an image; the first flashed once.
    assert bmcs[2].app[UPDATES].flashed == []
    assert len(bmcs[0].app[UPDATES].flashed) == 1


async def test_pause_resume_abort_and_roles(env: Env, bmcs: list[LabRedfish]) -> None:
    e, t = env, env.tokens
    ids = await _machines(e, bmcs)
    body = {"profile": "h100-8x", "version": 1}
    # Technicians read rollouts, never start them; tenants see nothing.
    r = await e.client.post("/api/v1/firmware/rollouts", json=body, headers=t.header("technician"))
    assert r.status == 403
    r = await e.client.get("/api/v1/firmware/rollouts", headers=t.header("orchestrator"))
    assert r.status == 403
    r = await e.client.post(
        "/api/v1/firmware/rollouts", json={**body, "version": 9}, headers=t.header("admin")
    )
    assert r.status == 422 and "version 9" in (await r.json())["detail"]
    created = await _create(e)  # no driver runs yet: nothing starts
    rid = created["id"]
    act = f"/api/v1/firmware/rollouts/{rid}/actions"
    r = await e.client.post(act, json={"action": "pause"}, headers=t.header("technician"))
    assert r.status == 403
    r = await e.client.post(act, json={"action": "pause"}, headers=t.header("admin"))
    assert r.status == 200 and (await r.json())["state"] == "paused"
    # A second rollout over the same machines is refused while this one runs.
    r = await e.client.post("/api/v1/firmware/rollouts", json=body, headers=t.header("admin"))
    assert r.status == 409
    ro = _rollouts(e)
    await ro.tick()
    assert set(_status(await _get(e, rid)).values()) == {"pending"}  # paused: nothing
    await ro.start()
    try:
        r = await e.client.post(act, json={"action": "resume"}, headers=t.header("admin"))
        assert r.status == 200
        await _until(e, rid, lambda r: r["progress"]["done"] >= 1)
        r = await e.client.post(act, json={"action": "abort"}, headers=t.header("admin"))
        assert r.status == 200
        got = await _until(e, rid, lambda r: r["finished_at"] is not None)
    finally:
        await ro.stop()
    assert got["state"] == "aborted"
    assert "pending" in _status(got).values()  # the rest untouched
    r = await e.client.post(act, json={"action": "resume"}, headers=t.header("admin"))
    assert r.status == 409
    r = await e.client.get("/api/v1/firmware/rollouts", headers=t.header("technician"))
    [item] = (await r.json())["items"]
    assert (
        item["id"] == rid
        and item["progress"]["total"] == N
        and "targets" not in item
        or (item["targets"] is None)
    )
    assert ids


async def test_survivor_takes_over(env: Env, bmcs: list[LabRedfish]) -> None:
    """The instance driving a rollout dies (its service stopped, its lease left); another
    takes it over once the lease ran out and finishes it, each BMC flashed once."""
    e = env
    ids = await _machines(e, bmcs)
    first = _rollouts(e, "metald-a", lease_s=3)
    rid = (await _create(e, batch_size=3, max_unavailable=3))["id"]
    await first.tick()  # takes the lease, starts the wave
    await first.stop()
    with e.store.session() as s:
        r = s.get(FirmwareRollout, rid)
        assert r is not None and r.owner == "metald-a"
    second = _rollouts(e, "metald-b", lease_s=5)
    assert await second.tick() == []  # the lease still holds
    await second.start()
    try:
        done = await _until(e, rid, lambda r: r["finished_at"] is not None)
    finally:
        await second.stop()
    assert done["state"] == "done" and set(_status(done).values()) == {"done"}
    with e.store.session() as s:
        took = s.exec(select(Event).where(Event.kind == "firmware.rollout")).all()
        assert any("took the rollout over from metald-a" in (ev.reason or "") for ev in took)
    for p in bmcs:
        assert len(p.app[UPDATES].flashed) == 1
    assert ids


def test_a_plan_decided_before_an_abort_is_dropped(store: Any) -> None:
    """The driver decided while the rollout ran; an admin aborted it before the plan was
    recorded: nothing starts and the rollout stays aborted (the row is locked and its state
    checked where the plan is recorded)."""
    from metald.firmware import rollouts as ro_mod
    from metald.store.models import FirmwareRolloutTarget
    from tests.conftest import seed

    t = seed(store)
    with store.session() as s:
        r = FirmwareRollout(profile="h100-8x", baseline_version=1, batch_size=1,
                            max_unavailable=1, failure_budget=1, in_use="skip",
                            state="running", created_by="test")  # fmt: skip
        s.add(r)
        s.flush()
        s.add(FirmwareRolloutTarget(rollout_id=r.id, machine_id=t.machine_free, seq=0,
                                    status="pending"))  # fmt: skip
        s.commit()
        rid = r.id
    with store.session() as s:
        decided = ro_mod._decide(s, rid)
    assert decided is not None and decided[0].start == [t.machine_free]
    with store.session() as s:
        r = s.get(FirmwareRollout, rid)
        assert r is not None
        r.state = "aborted"
        s.add(r)
        s.commit()
    with store.session() as s:
        assert ro_mod._apply(s, rid, decided[0], decided[1], "test", "test") == []
    with store.session() as s:
        r = s.get(FirmwareRollout, rid)
        m = s.get(Machine, t.machine_free)
        assert r is not None and r.state == "aborted" and m is not None and m.state == "ready"
