"""Redfish events pushed by the lab Redfish BMC (vm-lab/vmlab/redfish_events.py) to metald's
``POST /api/v1/bmc-events/{bmc_id}``: the entry becomes the BMC's fault and the running watch,
woken, drains the node at once (fault -> drained printed); a forged event (no secret, a wrong
one, another BMC's) is refused and records nothing; an entry pushed and then polled is one
fault, not two."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import aiohttp
from sqlmodel import select

from api.app import CTX_KEY
from metald.bmc.base import BmcEndpoint
from metald.bmc.redfish import RedfishDriver
from metald.health.config import HealthConfig
from metald.healthwatch import pushed
from metald.healthwatch.watch import HealthWatch
from metald.store.models import Bmc, BmcEventSubscription, BmcLogCursor, Event, HealthFault
from tests.bmc.peers import LabRedfish
from tests.healthwatch.helpers import FakeScheduler, active_claim, node_name, rem_rows, workflow
from vmlab import redfish_events

UECC = "Memory #0x01 Uncorrectable ECC | Asserted"


def _bmc(store: Any, machine_id: str, port: int) -> str:
    with store.session() as s:
        b = Bmc(machine_id=machine_id, address="127.0.0.1", port=port, protocol="redfish",
                username="u", password_enc=b"x")  # fmt: skip
        s.add(b)
        s.commit()
        return b.id


def _secret_for(store: Any, bmc_id: str) -> str:
    secret = pushed.new_secret()
    with store.session() as s:
        s.add(BmcEventSubscription(bmc_id=bmc_id, secret_hash=pushed.secret_hash(secret),
                                   owner="i1", created_at=datetime.now(UTC)))  # fmt: skip
        s.commit()
    return secret


async def _subscribe(lab: LabRedfish, dest: str, secret: str) -> None:
    auth = {"Authorization": aiohttp.encode_basic_auth(lab.username, lab.password)}
    async with aiohttp.ClientSession(headers=auth) as http:
        r = await http.post(
            f"http://127.0.0.1:{lab.port}{redfish_events.SUBSCRIPTIONS}",
            json={"Destination": dest, "Protocol": "Redfish", "EventTypes": ["Alert"],
                  "HttpHeaders": [{"X-Metald-Event-Secret": secret}]},
        )  # fmt: skip
        assert r.status == 201


def _faults(store: Any) -> list[HealthFault]:
    with store.session() as s:
        return list(s.exec(select(HealthFault)).all())


async def test_a_pushed_entry_is_drained_at_once(api, lab_redfish: LabRedfish) -> None:  # type: ignore[no-untyped-def]
    client, _tokens, store = api
    ctx = client.app[CTX_KEY]
    ctx.cfg = ctx.cfg.model_copy(update={"health": HealthConfig(watch_interval_s=3600)})
    cfg = ctx.cfg.health
    c = active_claim(store, 1, spares=1, tenant="pushed")
    bmc_id = _bmc(store, c.machines[0], lab_redfish.port)
    node = node_name(store, c.machines[0])
    sched = FakeScheduler()
    sched.jobs[node] = ["7"]  # a job runs on: the remediation waits at wait-jobs
    watch = HealthWatch(store, cfg, "i1", remediations=workflow(store, sched, cfg),
                        table=cfg.table())  # fmt: skip
    await watch.start()
    try:
        ctx.services = ctx.services.__class__(health_watch=watch)
        secret = _secret_for(store, bmc_id)
        await _subscribe(lab_redfish, str(client.make_url(f"/api/v1/bmc-events/{bmc_id}")),
                         secret)  # fmt: skip
        events = lab_redfish.app[redfish_events.EVENTS]
        t0 = time.monotonic()
        entry = events.add(UECC)
        deadline = time.monotonic() + 5  # the goal: a BMC log entry -> drained <= 5 s
        while node not in sched.drained:
            assert time.monotonic() < deadline, rem_rows(store)
            await asyncio.sleep(0.01)
        print(f"Redfish log entry -> pushed -> drained (lab BMC, API, woken watch): "
              f"{(time.monotonic() - t0) * 1000:.0f} ms")  # fmt: skip
        assert events.pushes[-1][1] == 200
        (f,) = _faults(store)
        assert (f.witness, f.kind, f.rule, f.severity) == (
            "bmc", "redfish-log", "redfish-memory-uncorrectable", "fatal"
        )  # fmt: skip
        assert f.evidence.startswith(f"#{entry.id} ") and UECC in f.evidence
        assert sched.drained[node].startswith(f"metald: #{entry.id} ")
        with store.session() as s:
            ev = s.exec(select(Event).where(Event.kind == "health.fault")).one()
            assert ev.data["witness"] == "bmc" and ev.data["claim_id"] == c.claim_id
    finally:
        await watch.stop()


async def test_a_forged_event_is_refused_and_records_nothing(api) -> None:  # type: ignore[no-untyped-def]
    client, _tokens, store = api
    c = active_claim(store, 2, spares=0, tenant="pushed")
    a = _bmc(store, c.machines[0], 1)
    b = _bmc(store, c.machines[1], 2)
    secret_a = _secret_for(store, a)
    _secret_for(store, b)
    body = {
        "@odata.type": "#Event.v1_7_0.Event", "Id": "1", "Name": "x",
        "Events": [{"EventType": "Alert", "Message": UECC, "Severity": "Critical",
                    "OriginOfCondition": {"@odata.id": "/redfish/v1/x/Entries/9"}}],
    }  # fmt: skip
    url = f"/api/v1/bmc-events/{b}"
    for headers, extra in (
        ({}, {}),  # no secret
        ({"X-Metald-Event-Secret": "guess"}, {}),
        ({"X-Metald-Event-Secret": secret_a}, {}),  # BMC a's secret for BMC b
        ({}, {"Context": secret_a}),
    ):
        r = await client.post(url, json={**body, **extra}, headers=headers)
        assert r.status == 401, await r.text()
        assert r.headers["Content-Type"].startswith("application/problem+json")
        assert "secret" in (await r.json())["detail"]
    # an unknown BMC: the same answer
    r = await client.post("/api/v1/bmc-events/nope", json=body,
                          headers={"X-Metald-Event-Secret": secret_a})  # fmt: skip
    assert r.status == 401
    # too large a body
    big = {**body, "Events": [{"Message": "x" * 70_000}]}
    r = await client.post(url, json=big, headers={"X-Metald-Event-Secret": secret_a})
    assert r.status == 413
    assert _faults(store) == [] and rem_rows(store) == []
    with store.session() as s:
        assert all(x.events == 0 and x.keys == [] for x in s.exec(select(BmcEventSubscription)))
    # BMC a's own secret, unknown fields and all, in the Context: accepted, for BMC a only
    r = await client.post(f"/api/v1/bmc-events/{a}",
                          json={**body, "Context": secret_a, "Oem": {"x": 1}})  # fmt: skip
    assert r.status == 200, await r.text()
    assert (await r.json()) == {"entries": 1, "signals": 1, "new_faults": 1}
    (f,) = _faults(store)
    assert f.machine_id == c.machines[0]


async def test_an_entry_pushed_then_polled_is_one_fault(api, lab_redfish: LabRedfish) -> None:  # type: ignore[no-untyped-def]
    client, _tokens, store = api
    ctx = client.app[CTX_KEY]
    cfg = ctx.cfg.health
    c = active_claim(store, 1, spares=1, tenant="pushed")
    bmc_id = _bmc(store, c.machines[0], lab_redfish.port)
    sched = FakeScheduler()
    sched.jobs[node_name(store, c.machines[0])] = ["7"]
    driver = RedfishDriver(
        BmcEndpoint("127.0.0.1", lab_redfish.port, lab_redfish.username, lab_redfish.password),
        scheme="http",
    )

    class Reads:
        async def event_log(self, machine_id: str) -> list[dict[str, Any]]:
            return [{"id": e.id, "at": e.at, "severity": e.severity, "message": e.message}
                    for e in await driver.event_log()]  # fmt: skip

        async def sensors(self, machine_id: str) -> list[dict[str, Any]]:
            return []

    watch = HealthWatch(store, cfg, "i1", remediations=workflow(store, sched, cfg),
                        table=cfg.table(), bmc=Reads())  # fmt: skip
    events = lab_redfish.app[redfish_events.EVENTS]
    try:
        events.add("System boot", "OK")
        await watch.round(reads=True)  # the first read sets the cursor
        secret = _secret_for(store, bmc_id)
        await _subscribe(lab_redfish, str(client.make_url(f"/api/v1/bmc-events/{bmc_id}")),
                         secret)  # fmt: skip
        events.add(UECC)
        await events.idle()
        assert events.pushes[-1][1] == 200
        assert [f.rule for f in _faults(store)] == ["redfish-memory-uncorrectable"]
        await watch.round(reads=True)  # polling now reads the same entry
        await watch.round(reads=True)
        (f,) = _faults(store)
        assert f.count == 1  # not seen a second time
        with store.session() as s:
            assert s.get(BmcLogCursor, bmc_id).entries == 2
            assert s.get(BmcEventSubscription, bmc_id).keys == []  # the cursor holds it now
        # polled first, pushed late (a retry): still one
        r = await client.post(f"/api/v1/bmc-events/{bmc_id}", headers={"X-Metald-Event-Secret": secret},
                              json=redfish_events.event_body(
                                  next(iter(events.subscriptions.values())), events.entries[-1]))  # fmt: skip
        assert (await r.json())["signals"] == 0
        (f,) = _faults(store)
        assert f.count == 1
    finally:
        await driver.close()


class _DriverBmc:
    """The BMC service's reads and event subscription calls, over one lab Redfish driver."""

    def __init__(self, driver: RedfishDriver) -> None:
        self.d = driver

    async def event_log(self, machine_id: str) -> list[dict[str, Any]]:
        return [{"id": e.id, "at": e.at, "severity": e.severity, "message": e.message}
                for e in await self.d.event_log()]  # fmt: skip

    async def sensors(self, machine_id: str) -> list[dict[str, Any]]:
        return []

    async def event_subscribe(self, machine_id: str, destination: str, secret: str) -> str | None:
        return await self.d.event_subscribe(destination, secret)

    async def event_subscription_alive(self, machine_id: str, uri: str) -> bool:
        return await self.d.event_subscription_alive(uri)

    async def event_unsubscribe(self, machine_id: str, uri: str) -> None:
        await self.d.event_unsubscribe(uri)


async def test_the_owner_subscribes_resubscribes_and_hands_over(
    api, lab_redfish: LabRedfish
) -> None:  # type: ignore[no-untyped-def]
    from metald.healthwatch import watch as watch_mod

    client, _tokens, store = api
    base = str(client.make_url("/")).rstrip("/")
    cfg = HealthConfig(bmc_events_url=base)
    c = active_claim(store, 1, spares=1, tenant="pushed")
    bmc_id = _bmc(store, c.machines[0], lab_redfish.port)
    sched = FakeScheduler()
    sched.jobs[node_name(store, c.machines[0])] = ["7"]
    driver = RedfishDriver(
        BmcEndpoint("127.0.0.1", lab_redfish.port, lab_redfish.username, lab_redfish.password),
        scheme="http",
    )
    events = lab_redfish.app[redfish_events.EVENTS]

    def watch_of(instance: str) -> HealthWatch:
        return HealthWatch(store, cfg, instance, remediations=workflow(store, sched, cfg, instance),
                           table=cfg.table(), bmc=_DriverBmc(driver))  # fmt: skip

    try:
        w1 = watch_of("i1")
        await w1.round(reads=True)  # the owner's first visit subscribes
        (sub,) = events.subscriptions.values()
        assert sub.destination == f"{base}/api/v1/bmc-events/{bmc_id}"
        with store.session() as s:
            row = s.get(BmcEventSubscription, bmc_id)
            assert row.owner == "i1" and row.uri == f"{redfish_events.SUBSCRIPTIONS}/{sub.id}"
            assert row.secret_hash == pushed.secret_hash(sub.headers["X-Metald-Event-Secret"])
        await w1.round(reads=True)
        assert list(events.subscriptions) == [sub.id]  # not made twice

        # pushed: the entry is recorded through the route (no poll in between)
        events.add(UECC)
        await events.idle()
        assert events.pushes[-1] == (sub.id, 200)
        assert [f.rule for f in _faults(store)] == ["redfish-memory-uncorrectable"]

        # the BMC restarts and forgets it: made again at the next check
        events.lose_subscriptions()
        for _ in range(watch_mod.FULL_READ_EVERY):
            await w1.round(reads=True)
        (again,) = events.subscriptions.values()
        assert again.id != sub.id

        # another instance owns the BMC now: it deletes i1's subscription and makes its own
        w2 = watch_of("i2")
        await w2.round(reads=True)
        (mine,) = events.subscriptions.values()
        assert mine.id != again.id
        with store.session() as s:
            assert s.get(BmcEventSubscription, bmc_id).owner == "i2"
        # i1's secret no longer works
        r = await client.post(f"/api/v1/bmc-events/{bmc_id}", json={"Events": []},
                              headers={"X-Metald-Event-Secret": again.headers["X-Metald-Event-Secret"]})  # fmt: skip
        assert r.status == 401

        # the machine leaves use: its owner deletes the subscription on the BMC
        from metald import machines as ms
        from metald.lifecycle import Trigger

        with store.session() as s:
            ms.transition(s, c.machines[0], Trigger.RELEASE, actor="t",
                          updates={"tenant_id": None})  # fmt: skip
        await w2.round(reads=True)
        assert events.subscriptions == {}
        with store.session() as s:
            assert s.get(BmcEventSubscription, bmc_id).uri is None
    finally:
        await driver.close()
