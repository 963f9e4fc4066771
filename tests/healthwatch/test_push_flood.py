"""A hostile BMC (or anything on the management network) flooding the routes machines push to
on their own: ``POST /api/v1/bmc-events/{bmc_id}`` and ``POST /api/v1/health/report``. Past
``[health.intake]`` each request is a 429 with Retry-After, decided before the store is
touched (no SQL statement at all), and counted in ``metald_machine_pushes_total``; a
well-behaved BMC behind its own bucket is still served. Prints the CPU a refused request costs
(client and server in this one process)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

from api.app import CTX_KEY
from metald.health.config import HealthConfig, IntakeConfig
from metald.metrics import REGISTRY
from tests.healthwatch.helpers import active_claim
from tests.healthwatch.test_pushed_events import UECC, _bmc, _faults, _secret_for

BODY = {
    "@odata.type": "#Event.v1_7_0.Event", "Id": "1", "Name": "x",
    "Events": [{"EventType": "Alert", "Message": UECC, "Severity": "Critical",
                "OriginOfCondition": {"@odata.id": "/redfish/v1/x/Entries/9"}}],
}  # fmt: skip


def _count(route: str, outcome: str) -> float:
    v = REGISTRY.get_sample_value(
        "metald_machine_pushes_total", {"route": route, "outcome": outcome}
    )
    return v or 0.0


@contextmanager
def _statements() -> Iterator[list[str]]:
    seen: list[str] = []

    def count(*a: Any) -> None:
        seen.append(a[2])

    event.listen(Engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", count)


def _intake(client: Any, **kw: Any) -> None:
    ctx = client.app[CTX_KEY]
    ctx.cfg = ctx.cfg.model_copy(update={"health": HealthConfig(intake=IntakeConfig(**kw))})


async def test_a_flooding_bmc_gets_429_before_the_store_and_is_counted(api) -> None:  # type: ignore[no-untyped-def]
    client, _tokens, store = api
    # No refill within the test (deterministic): 5 per BMC, 40 per source address.
    _intake(client, bmc_event_burst=5, bmc_event_per_s=0.001, source_burst=40,
            source_per_s=0.001)  # fmt: skip
    c = active_claim(store, 2, spares=0, tenant="flood")
    hostile, honest = _bmc(store, c.machines[0], 1), _bmc(store, c.machines[1], 2)
    _secret_for(store, hostile)
    honest_secret = _secret_for(store, honest)
    limited0 = _count("bmc-events", "limited-key")
    refused0 = _count("bmc-events", "refused")
    codes = []
    for _ in range(5):  # the burst: each costs its secret check, and is refused (401)
        r = await client.post(f"/api/v1/bmc-events/{hostile}", json=BODY,
                              headers={"X-Metald-Event-Secret": "guess"})  # fmt: skip
        codes.append(r.status)
    assert codes == [401] * 5
    n = 20
    with _statements() as sql:
        cpu0 = time.process_time()
        for _ in range(n):
            r = await client.post(f"/api/v1/bmc-events/{hostile}", json=BODY,
                                  headers={"X-Metald-Event-Secret": "guess"})  # fmt: skip
            assert r.status == 429, await r.text()
            assert r.headers["Content-Type"].startswith("application/problem+json")
            assert int(r.headers["Retry-After"]) >= 1
            assert "faster than metald takes them" in (await r.json())["detail"]
        per = (time.process_time() - cpu0) / n
    assert sql == []  # refused before the store: not one statement
    print(f"\na refused (429) pushed event: {per * 1000:.2f} ms CPU, client and server together")
    assert _count("bmc-events", "limited-key") - limited0 == n
    assert _count("bmc-events", "refused") - refused0 == 5
    # The honest BMC, same address, its own bucket: served.
    r = await client.post(f"/api/v1/bmc-events/{honest}", json=BODY,
                          headers={"X-Metald-Event-Secret": honest_secret})  # fmt: skip
    assert r.status == 200, await r.text()
    assert [f.machine_id for f in _faults(store)] == [c.machines[1]]
    # Inventing BMC ids does not buy a fresh budget: the source address's bucket ends it
    # (40 in all from this address: 5 + 1 taken above).
    statuses = []
    for i in range(40):
        r = await client.post(f"/api/v1/bmc-events/made-up-{i}", json=BODY)
        statuses.append(r.status)
    assert statuses == [401] * 34 + [429] * 6
    assert _count("bmc-events", "limited-source") >= 6


async def test_a_flood_of_guessed_node_tokens_gets_429_before_the_store(api) -> None:  # type: ignore[no-untyped-def]
    client, _tokens, _store = api
    _intake(client, report_burst=3, report_per_s=0.001, source_burst=10, source_per_s=0.001)
    headers = {"Authorization": "Bearer mnt_" + "g" * 40}
    got = []
    for _ in range(5):
        r = await client.post("/api/v1/health/report", json={"kernel_log": ""}, headers=headers)
        got.append(r.status)
    assert got == [401, 401, 401, 429, 429]  # the same guessed token: 3, then refused
    with _statements() as sql:
        for i in range(10):
            h = {"Authorization": f"Bearer mnt_{i:040d}"}
            r = await client.post("/api/v1/health/report", json={"kernel_log": ""}, headers=h)
            got.append(r.status)
    # fresh tokens, one address: 10 let through in all (3 above; a refusal takes no token)
    assert got[5:] == [401] * 7 + [429] * 3
    assert len(sql) <= 7 * 4  # only the seven let through read the store
