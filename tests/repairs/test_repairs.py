"""The repair queue through the API on both backends: opened by hand or by a remediation,
taken, noted, repaired; commissioning's verdict returns the machine to the pool or counts a
failure, and the second failure after repair keeps it out with a sentence. Staff only."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlmodel import select

from metald import machines
from metald.lifecycle import State, Trigger
from metald.provision import watchdog
from metald.store.models import Event, Machine, Repair, utcnow
from metald.usecases.repairs import RepairQueue
from tests.commissioning.test_api import (
    FIO_OK,
    SMART_MEDIA_ERRORS,
    SMART_OK,
    _inventoried,
    profile,
    report,
)
from tests.test_enrollment import enrolled_via_hooks, payload


@dataclass(frozen=True)
class Fault:
    """A fault record as the remediation workflow hands it over (a plain dataclass)."""

    kind: str
    subject: str
    code: str
    severity: str
    witness: str
    evidence: str
    first_seen: datetime
    part: str = ""


SEL_ECC = Fault(
    "sel", "bmc", "critical: Memory CPU1_DIMM_B1 Uncorrectable ECC", "fatal", "bmc",
    "#41 2026-12-06T10:00:00+00:00 critical Memory CPU1_DIMM_B1 Uncorrectable ECC",
    datetime(2026, 12, 6, 10, 0, 5), "dimm",
)  # fmt: skip


async def _ready(client: Any, store: Any) -> tuple[str, dict[str, str]]:
    """A machine commissioned (passed) and ready; the profile stays in the enroll rules."""
    target, agent = await _inventoried(client, store, profile())
    r = await client.post(
        "/api/v1/agent/commissioning",
        json={"results": [report("smart", SMART_OK), report("fio", FIO_OK)]},
        headers=agent,
    )
    assert (await r.json())["state"] == "ready"
    return target.machine_id, agent


async def _boot_and_commission(client: Any, store: Any, mid: str, smart: str) -> dict[str, Any]:
    """The repaired machine's discovery boot: a fresh token, the inventory, the checks."""
    _hooks, target = await enrolled_via_hooks(store)
    assert target.machine_id == mid
    agent = {"Authorization": f"Bearer {target.kernel_args['metald.token']}"}
    r = await client.post(
        "/api/v1/agent/inventory", json=payload(mid, boot_id=str(uuid.uuid4())), headers=agent
    )
    assert (await r.json())["state"] == "commissioning", await r.text()
    r = await client.post(
        "/api/v1/agent/commissioning",
        json={"results": [report("smart", smart), report("fio", FIO_OK)]},
        headers=agent,
    )
    return dict(await r.json())


async def _state(store: Any, mid: str) -> Machine:
    with store.session() as s:
        m = s.get(Machine, mid)
        assert m is not None
        s.expunge(m)
        return m


async def test_failing_commissioning_twice_after_repair_keeps_the_machine_out(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    tech, admin = tokens.header("technician"), tokens.header("admin")
    mid, _agent = await _ready(client, store)
    r = await client.post(
        "/api/v1/repairs",
        json={"machine": mid, "summary": "smartctl shows media errors on nvme0n1", "part": "disk"},
        headers=tech,
    )
    rep = await r.json()
    assert r.status == 201, rep
    rid = rep["id"]
    assert r.headers["Location"] == f"/api/v1/repairs/{rid}"
    assert (rep["status"], rep["source"], rep["machine"]["state"]) == (
        "open", "technician", "broken",
    )  # fmt: skip
    assert rep["machine"]["rack_position"] == "leaf-r12/Eth1/7"
    assert rep["actions"] == ["take", "note"]
    # A second open for the same machine adds to the open repair, never a second one.
    r = await client.post(
        "/api/v1/repairs", json={"machine": mid, "summary": "fan noise"}, headers=admin
    )
    assert (await r.json())["id"] == rid and len((await r.json())["faults"]) == 2

    for attempt in (1, 2):
        r = await client.post(f"/api/v1/repairs/{rid}/take", headers=tech)
        body = await r.json()
        assert r.status == 200, body
        assert (body["status"], body["taken_by"], body["machine"]["state"]) == (
            "taken", "technician:technician", "repairing",
        )  # fmt: skip
        r = await client.post(f"/api/v1/repairs/{rid}/take", headers=admin)
        assert r.status == 409 and "taken by technician" in (await r.json())["detail"]
        r = await client.post(
            f"/api/v1/repairs/{rid}/note", json={"text": f"swapped nvme0n1 ({attempt})"},
            headers=tech,
        )  # fmt: skip
        assert (await r.json())["notes"][-1]["text"] == f"swapped nvme0n1 ({attempt})"
        r = await client.post(f"/api/v1/repairs/{rid}/repaired", json={}, headers=tech)
        body = await r.json()
        assert r.status == 202, body
        assert (body["status"], body["machine"]["state"]) == ("verifying", "inspecting")
        out = await _boot_and_commission(client, store, mid, SMART_MEDIA_ERRORS)
        assert out["state"] == "broken", out
        r = await client.get(f"/api/v1/repairs/{rid}", headers=tech)
        body = await r.json()
        assert body["commission_failures"] == attempt
        if attempt == 1:
            assert body["status"] == "open" and body["outcome"] is None
            assert "back in the repair queue" in body["machine"]["last_error"]

    assert (body["status"], body["outcome"]) == ("closed", "out")
    m = await _state(store, mid)
    assert m.state == "broken"
    assert m.last_error is not None and m.last_error.startswith(
        "failed commissioning 2 times after repair (last: run "
    )
    assert "stays out of the pool" in m.last_error and body["outcome_reason"] == m.last_error
    # Nothing to take any more; a technician cannot overrule the rule, an admin can.
    r = await client.post(f"/api/v1/repairs/{rid}/take", headers=tech)
    assert r.status == 409
    r = await client.post(
        "/api/v1/repairs", json={"machine": mid, "summary": "new backplane"}, headers=tech
    )
    assert r.status == 403 and "only an admin" in (await r.json())["detail"]
    r = await client.post(
        "/api/v1/repairs", json={"machine": mid, "summary": "new backplane"}, headers=admin
    )
    assert r.status == 201 and (await r.json())["id"] != rid
    with store.session() as s:
        kinds = [
            e.kind
            for e in s.exec(select(Event).where(Event.machine_id == mid).order_by(Event.id))
            if e.kind.startswith("repair.")
        ]
    assert kinds == [
        "repair.opened", "repair.faults",
        "repair.taken", "repair.note", "repair.repaired", "repair.failed",
        "repair.taken", "repair.note", "repair.repaired", "repair.out",
        "repair.opened",
    ]  # fmt: skip


async def test_a_pass_after_repair_returns_the_machine_to_the_pool(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    tech = tokens.header("technician")
    mid, _agent = await _ready(client, store)
    with store.session() as s:
        RepairQueue("t").open(s, machine_id=mid, remediation_id="rem-1", faults=[SEL_ECC])
        s.commit()
    r = await client.get("/api/v1/repairs", headers=tech)
    page = await r.json()
    assert page["total"] == 1
    rep = page["items"][0]
    assert (rep["source"], rep["remediation_id"], rep["machine"]["state"]) == (
        "remediation", "rem-1", "broken",
    )  # fmt: skip
    assert rep["parts"] == [
        {"part": "dimm", "where": "DIMM slot CPU1_DIMM_B1", "slot": "CPU1_DIMM_B1"}
    ]
    assert rep["faults"][0]["evidence"] == SEL_ECC.evidence
    assert rep["faults"][0]["first_seen"] == "2026-12-06T10:00:05"
    # The remediation retried: still one repair.
    with store.session() as s:
        RepairQueue("t").open(s, machine_id=mid, remediation_id="rem-1", faults=[SEL_ECC])
        s.commit()
        assert len(s.exec(select(Repair)).all()) == 1
    rid = rep["id"]
    # "repaired" before anyone took it: refused, nothing changed.
    r = await client.post(f"/api/v1/repairs/{rid}/repaired", json={}, headers=tech)
    assert r.status == 409 and "take it first" in (await r.json())["detail"]
    assert (await _state(store, mid)).state == "broken"
    await client.post(f"/api/v1/repairs/{rid}/take", headers=tech)
    r = await client.post(
        f"/api/v1/repairs/{rid}/repaired", json={"note": "reseated DIMM B1"}, headers=tech
    )
    assert (await r.json())["notes"][-1]["text"] == "reseated DIMM B1"
    out = await _boot_and_commission(client, store, mid, SMART_OK)
    assert out["state"] == "ready"
    r = await client.get(f"/api/v1/repairs/{rid}", headers=tech)
    body = await r.json()
    assert (body["status"], body["outcome"], body["commission_failures"]) == (
        "closed", "returned", 0,
    )  # fmt: skip
    assert (await client.get("/api/v1/repairs", headers=tech)).status == 200
    r = await client.get("/api/v1/repairs?status=closed", headers=tech)
    assert [x["id"] for x in (await r.json())["items"]] == [rid]
    r = await client.get("/api/v1/repairs", headers=tech)
    assert (await r.json())["total"] == 0


async def test_the_watchdog_fails_a_repaired_machine_that_never_commissions(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    tech = tokens.header("technician")
    mid, _agent = await _ready(client, store)
    r = await client.post(
        "/api/v1/repairs", json={"machine": mid, "summary": "no POST"}, headers=tech
    )
    rid = (await r.json())["id"]
    await client.post(f"/api/v1/repairs/{rid}/take", headers=tech)
    await client.post(f"/api/v1/repairs/{rid}/repaired", json={}, headers=tech)
    with store.session() as s:
        moved = watchdog.sweep(
            s, {State.INSPECTING: 60}, actor="t", now=utcnow() + timedelta(seconds=61)
        )
        assert moved == [mid]
    body = await (await client.get(f"/api/v1/repairs/{rid}", headers=tech)).json()
    assert (body["status"], body["commission_failures"]) == ("open", 1)
    assert body["machine"]["state"] == "broken"
    assert "stuck in inspecting" in body["machine"]["last_error"]


async def test_only_staff_see_or_touch_repairs(api) -> None:  # type: ignore[no-untyped-def]
    """Orchestrators (even of the machine's tenant) get 403 on every repair route, agents are refused,
    and see no repair events; a technician cannot take a repair while a tenant's claim holds
    the machine."""
    client, tokens, store = api
    admin = tokens.header("admin")
    r = await client.post(
        "/api/v1/repairs",
        json={"machine": tokens.machine_a, "summary": "GPU fell off the bus", "part": "gpu"},
        headers=admin,
    )
    rid = (await r.json())["id"]
    assert r.status == 201
    for role in ("orchestrator", "orchestrator_other", "agent"):
        h = tokens.header(role)
        calls = [
            ("GET", "/api/v1/repairs", None),
            ("GET", f"/api/v1/repairs/{rid}", None),
            ("GET", f"/api/v1/repairs/{rid[:8]}", None),
            ("POST", "/api/v1/repairs", {"machine": tokens.machine_a, "summary": "x"}),
            ("POST", f"/api/v1/repairs/{rid}/take", None),
            ("POST", f"/api/v1/repairs/{rid}/note", {"text": "x"}),
            ("POST", f"/api/v1/repairs/{rid}/repaired", {}),
        ]
        for method, path, body in calls:
            r = await client.request(method, path, json=body, headers=h)
            assert r.status in (401, 403, 404), (role, method, path, r.status)
            assert r.status != 404 or role == "agent"
    r = await client.get("/api/v1/events", headers=tokens.header("orchestrator"))
    assert not [e for e in (await r.json())["items"] if e["kind"].startswith("repair.")]
    r = await client.get(f"/api/v1/repairs/{rid}", headers=tokens.header("technician"))
    assert r.status == 200
    # Still the tenant's (the claim was not released): nobody takes it yet.
    r = await client.post(f"/api/v1/repairs/{rid}/take", headers=tokens.header("technician"))
    assert r.status == 409 and "belongs to a tenant" in (await r.json())["detail"]
    with store.session() as s:
        assert s.get(Repair, rid).status == "open"  # type: ignore[union-attr]


async def test_retiring_a_machine_closes_its_repair(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    tech = tokens.header("technician")
    r = await client.post(
        "/api/v1/repairs", json={"machine": "node2", "summary": "bent chassis"}, headers=tech
    )
    rid = (await r.json())["id"]
    r = await client.post(
        f"/api/v1/machines/{tokens.machine_free}/actions", json={"action": "retire"},
        headers=tech,
    )  # fmt: skip
    assert r.status == 200, await r.text()
    body = await (await client.get(f"/api/v1/repairs/{rid}", headers=tech)).json()
    assert (body["status"], body["outcome"]) == ("closed", "retired")
    with store.session() as s:
        m = machines.get_machine(s, tokens.machine_free)
        assert m.state == "retired"
        # A retired machine is not repaired.
        from metald.errors import Conflict
        from metald.repairs import open_repair

        try:
            open_repair(s, m.id, faults=[SEL_ECC], source="technician", actor="t")
        except Conflict as e:
            assert "retired" in str(e)
        else:
            raise AssertionError("a retired machine got a repair")
    assert Trigger.TAKE_REPAIR.value == "take-repair"


async def test_a_machine_that_held_a_tenants_data_is_wiped_before_its_commissioning(api) -> None:  # type: ignore[no-untyped-def]
    """Taken from a tenant, the machine owes a wipe: "repaired" wipes it first, and the wipe's
    end (in its own transaction) requests the commissioning run that verifies the repair."""
    from api.app import CTX_KEY
    from metald.provision import commissioning
    from metald.provision.progress import Progress, record_progress

    client, tokens, store = api
    tech = tokens.header("technician")
    mid, _agent = await _ready(client, store)
    with store.session() as s:
        machines.update_fields(s, mid, actor="t", kind="test", values={"wipe_required": True})
    r = await client.post(
        "/api/v1/repairs", json={"machine": mid, "summary": "GPU 3 missing"}, headers=tech
    )
    rid = (await r.json())["id"]
    await client.post(f"/api/v1/repairs/{rid}/take", headers=tech)
    r = await client.post(f"/api/v1/repairs/{rid}/repaired", json={}, headers=tech)
    body = await r.json()
    assert (body["status"], body["machine"]["state"]) == ("verifying", "wiping"), body
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
        m = machines.get_machine(s, mid)
        m = record_progress(
            s,
            mid,
            Progress(phase="wipe", done=True, disks=evidence),
            actor="agent",
            token_boot=m.boot_current,
            on_wiped=lambda s, m: commissioning.after_wipe(s, m, rules, actor="agent"),
        )
        assert m.state == "inspecting"  # never ready in between
    out = await _boot_and_commission(client, store, mid, SMART_OK)
    assert out["state"] == "ready"
    body = await (await client.get(f"/api/v1/repairs/{rid}", headers=tech)).json()
    assert (body["status"], body["outcome"]) == ("closed", "returned")


def test_the_lifecycle_has_no_way_from_repair_to_the_pool_but_commissioning() -> None:
    from metald import lifecycle

    assert lifecycle.sources(Trigger.TAKE_REPAIR) == {State.BROKEN}
    leaves = {t for (src, t) in lifecycle.TRANSITIONS if src is State.REPAIRING}
    assert leaves == {Trigger.INSPECT, Trigger.WIPE, Trigger.MARK_BROKEN, Trigger.RETIRE}
    assert {State.BROKEN, State.REPAIRING} == lifecycle.IN_REPAIR
    assert State.REPAIRING in lifecycle.OUT_OF_SERVICE
    assert Trigger.TAKE_REPAIR in lifecycle.TENANT_BLOCKS


async def test_no_direct_action_moves_a_machine_around_the_queue(api) -> None:  # type: ignore[no-untyped-def]
    """While a repair holds the machine, the machine routes that could bring it to the pool
    without commissioning (inspect, maintenance, wipe, confirm-wipe, commission) are refused
    with the way through the queue; after the second failure only an admin may take it out of
    broken by hand."""
    client, tokens, store = api
    tech, admin = tokens.header("technician"), tokens.header("admin")
    mid, _agent = await _ready(client, store)
    r = await client.post(
        "/api/v1/repairs", json={"machine": mid, "summary": "DIMM errors"}, headers=tech
    )
    rid = (await r.json())["id"]
    for action in ("repair", "maintenance-on"):  # broken, in the queue
        r = await client.post(
            f"/api/v1/machines/{mid}/actions", json={"action": action}, headers=admin
        )
        assert r.status == 409 and f"/api/v1/repairs/{rid}/take" in (await r.json())["detail"]
    await client.post(f"/api/v1/repairs/{rid}/take", headers=tech)
    calls = [
        (f"/api/v1/machines/{mid}/actions", {"action": "inspect"}),
        (f"/api/v1/machines/{mid}/wipe", {}),
        (f"/api/v1/machines/{mid}/confirm-wipe", {"reason": "erased by hand"}),
        (f"/api/v1/machines/{mid}/commission", {}),
    ]
    for path, body in calls:
        r = await client.post(path, json=body, headers=tech)
        assert r.status == 409, (path, r.status, await r.text())
        assert f"in repair {rid} (taken)" in (await r.json())["detail"]
    assert (await _state(store, mid)).state == "repairing"
    # The repair ends out: a technician cannot take the machine out of broken by hand.
    with store.session() as s:
        from metald import repairs

        r_ = repairs.get(s, rid)
        repairs._save(
            s, r_, r_.version, status="closed", open_machine_id=None, outcome="out",
            commission_failures=2,
        )  # fmt: skip
        machines.transition(s, mid, Trigger.MARK_BROKEN, actor="t")
    for action in ("repair", "maintenance-on"):
        r = await client.post(
            f"/api/v1/machines/{mid}/actions", json={"action": action}, headers=tech
        )
        assert r.status == 403 and "only an admin" in (await r.json())["detail"]
    r = await client.post(
        f"/api/v1/machines/{mid}/actions", json={"action": "repair"}, headers=admin
    )
    assert r.status == 200 and (await r.json())["state"] == "maintenance"


async def test_a_remediation_id_names_one_machine(api) -> None:  # type: ignore[no-untyped-def]
    from metald.errors import Conflict

    client, tokens, store = api
    with store.session() as s:
        q = RepairQueue("t")
        q.open(s, machine_id=tokens.machine_free, remediation_id="rem-9", faults=[SEL_ECC])
        s.commit()
        try:
            q.open(s, machine_id=tokens.machine_b, remediation_id="rem-9", faults=[SEL_ECC])
        except Conflict as e:
            assert "already opened repair" in str(e)
        else:
            raise AssertionError("one remediation opened repairs on two machines")


async def test_two_technicians_taking_at_once_get_one_winner(api) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    client, tokens, store = api
    tech, admin = tokens.header("technician"), tokens.header("admin")
    r = await client.post(
        "/api/v1/repairs", json={"machine": "node2", "summary": "no video"}, headers=tech
    )
    rid = (await r.json())["id"]
    for _ in range(3):  # a few rounds: the race is decided by the store, not by luck
        answers = await asyncio.gather(
            client.post(f"/api/v1/repairs/{rid}/take", headers=tech),
            client.post(f"/api/v1/repairs/{rid}/take", headers=admin),
        )
        assert sorted(a.status for a in answers) == [200, 409]
        with store.session() as s:
            m = machines.get_machine(s, tokens.machine_free)
            assert m.state == "repairing"
            from metald import repairs

            rep = repairs.get(s, rid)
            winner = next(a for a in answers if a.status == 200)
            assert rep.taken_by == (await winner.json())["taken_by"]
            # Back in the queue for the next round.
            repairs._save(s, rep, rep.version, status="open", taken_by=None)
            machines.transition(s, m.id, Trigger.MARK_BROKEN, actor="t")
            s.commit()


async def test_a_taken_repair_is_released_back_to_the_queue(api) -> None:  # type: ignore[no-untyped-def]
    """Untake: the one who took a repair (or an admin) lets go of it without fixing it; the
    repair is open for anyone again and the machine broken again (out of service)."""
    client, tokens, store = api
    tech, admin = tokens.header("technician"), tokens.header("admin")
    r = await client.post(
        "/api/v1/repairs", json={"machine": "node2", "summary": "no video"}, headers=tech
    )
    rid = (await r.json())["id"]
    r = await client.post(f"/api/v1/repairs/{rid}/release", headers=tech)
    assert r.status == 409 and "only a taken repair" in (await r.json())["detail"]
    r = await client.post(f"/api/v1/repairs/{rid}/take", headers=admin)
    assert r.status == 200 and "release" in (await r.json())["actions"]
    # A technician cannot release someone else's repair.
    r = await client.post(f"/api/v1/repairs/{rid}/release", headers=tech)
    assert r.status == 403 and "taken by admin" in (await r.json())["detail"]
    r = await client.post(f"/api/v1/repairs/{rid}/release", headers=admin)
    assert r.status == 200, await r.text()
    body = await r.json()
    assert (body["status"], body["taken_by"], body["machine"]["state"]) == (
        "open", None, "broken",
    )  # fmt: skip
    assert body["actions"] == ["take", "note"]
    # Anyone may take it now; its taker may release it.
    assert (await client.post(f"/api/v1/repairs/{rid}/take", headers=tech)).status == 200
    r = await client.post(f"/api/v1/repairs/{rid}/release", headers=tech)
    assert r.status == 200 and (await r.json())["status"] == "open"
    with store.session() as s:
        kinds = [e.kind for e in s.exec(select(Event).where(Event.kind.startswith("repair.")))]  # type: ignore[attr-defined]
        assert kinds.count("repair.released") == 2
        assert machines.get_machine(s, tokens.machine_free).state == "broken"
    # An orchestrator never reaches it.
    r = await client.post(f"/api/v1/repairs/{rid}/release", headers=tokens.header("orchestrator"))
    assert r.status in (403, 404)


async def test_a_machine_from_the_pool_failing_commissioning_is_queued_with_its_evidence(
    api,
) -> None:  # type: ignore[no-untyped-def]
    """A machine that passed commissioning before (it was in the pool) and fails a later run
    goes to the repair queue by itself (source commissioning), broken, with the failed check's
    sentence as the evidence; a first commissioning failing (a new
    machine) stays commission-failed as before."""
    client, tokens, store = api
    tech = tokens.header("technician")
    mid, _agent = await _ready(client, store)
    r = await client.post(
        f"/api/v1/machines/{mid}/commission", json={"reason": "recheck"}, headers=tech
    )
    assert r.status == 202, await r.text()
    out = await _boot_and_commission(client, store, mid, SMART_MEDIA_ERRORS)
    assert out["status"] == "failed" and out["state"] == "broken", out
    r = await client.get("/api/v1/repairs", headers=tech)
    (rep,) = (await r.json())["items"]
    assert (rep["source"], rep["status"], rep["machine"]["id"]) == ("commissioning", "open", mid)
    (fault,) = rep["faults"]
    assert (fault["kind"], fault["subject"], fault["witness"]) == (
        "commissioning", "smart", "commissioning",
    )  # fmt: skip
    assert "7 NVMe media errors" in fault["evidence"]
    assert rep["actions"] == ["take", "note"]
    m = await _state(store, mid)
    assert m.state == "broken" and "in repair" in (m.last_error or "")
