"""What an agent's requests cost the store's writer, and what the agent no longer has to ask.

In a 1,000-machine power-on storm every request queues on SQLite's one writer thread behind
the other machines' enrollment. Before, each agent request went through it twice (the token's
lookup, which also opened a write transaction, then the handler), and a commissioning machine
sent two more requests after its inventory (``next``, then the plan) before its first check:
four waits in that queue, ~2.8 s of the storm's per-machine overhead. Now the token is looked
up on the store's read lane, its first use is stamped in the handler's own write transaction,
``next`` and the plan are reads, and the inventory's answer carries the plan."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from api.app import CTX_KEY
from metald.auth import Role, hash_token, issue_token
from metald.commissioning.profile import CheckSpec, CommissioningProfile
from metald.config import EnrollConfig
from metald.inventory.rules import EnrollmentRule
from metald.store.models import ApiToken
from tests.commissioning.test_api import FIO_OK, SMART_OK, profile, report
from tests.commissioning.test_post_cost import counted
from tests.test_enrollment import enrolled_via_hooks, payload


def writer_passes(store: Any, monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Counts the calls that go through the store's writer (``Store.run``) from now on;
    calling the result returns the count since its last call."""
    calls = [0, 0]
    run = store.run

    async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return await run(fn, *args, **kwargs)

    monkeypatch.setattr(store, "run", counted)

    def since() -> int:
        n = calls[0] - calls[1]
        calls[1] = calls[0]
        return n

    return since


async def _last_used(store: Any, secret: str) -> Any:
    def get(s: Any) -> Any:
        row = s.exec(ApiToken.__table__.select().where(ApiToken.token_hash == hash_token(secret)))
        return row.first().last_used_at

    return await store.read(get)


async def _inspecting(client: Any, store: Any, prof: CommissioningProfile) -> tuple[Any, str]:
    client.server.app[CTX_KEY].cfg.enroll = EnrollConfig(
        rules=[EnrollmentRule(match={"gpu_model": "*H100*"}, commissioning=prof)]
    )
    _hooks, target = await enrolled_via_hooks(store)
    return target, target.kernel_args["metald.token"]


async def test_a_commissioning_agent_waits_on_the_writer_once_per_write(  # type: ignore[no-untyped-def]
    api, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, _tokens, store = api
    target, secret = await _inspecting(client, store, profile())
    agent = {"Authorization": f"Bearer {secret}"}
    passes = writer_passes(store, monkeypatch)
    assert await _last_used(store, secret) is None

    # The inventory post is the token's first use: stamped in the post's own transaction, as
    # its last write (after the machine's row: the order in which a transition revokes tokens).
    with counted(store) as seen:
        r = await client.post(
            "/api/v1/agent/inventory",
            json=payload(target.machine_id, boot_id=str(uuid.uuid4())),
            headers=agent,
        )
    assert r.status == 200, await r.text()
    assert passes() == 1  # the old code: 2 (the lookup's write transaction, then the post)
    writes = [x for x in seen if x.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE"))]
    assert "last_used_at" in writes[-1], writes[-1]
    assert any(x.startswith("UPDATE machines") for x in writes)
    if store.is_sqlite:
        assert sum(x.startswith("BEGIN IMMEDIATE") for x in seen) == 1  # one write transaction
    assert await _last_used(store, secret) is not None
    nxt = (await r.json())["next"]
    # The answer carries the plan: the agent goes straight to its first check.
    assert nxt["action"] == "commission"
    assert [c["name"] for c in nxt["plan"]["checks"]] == ["smart", "fio"]

    # An agent of an older image still asks; both answers are reads, off the writer.
    r = await client.get("/api/v1/agent/next", headers=agent)
    assert (await r.json())["plan"] == nxt["plan"]
    r = await client.get("/api/v1/agent/commissioning", headers=agent)
    assert await r.json() == nxt["plan"]
    assert passes() == 0  # the old code: 4

    for name, raw, done in (("smart", SMART_OK, False), ("fio", FIO_OK, True)):
        r = await client.post(
            "/api/v1/agent/commissioning",
            json={"done": done, "results": [report(name, raw)]},
            headers=agent,
        )
        assert r.status == 200, await r.text()
        assert passes() == 1  # the old code: 2
    assert (await r.json())["state"] == "ready"


async def test_a_token_first_used_by_a_read_or_a_refusal_is_still_stamped(  # type: ignore[no-untyped-def]
    api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog tells a lost boot script (token minted, never used) from a running agent
    by ``last_used_at``: every request with the token counts, whatever its answer."""
    client, _tokens, store = api
    target, secret = await _inspecting(client, store, profile())
    agent = {"Authorization": f"Bearer {secret}"}
    passes = writer_passes(store, monkeypatch)
    r = await client.get("/api/v1/agent/next", headers=agent)  # a read: one write to stamp it
    assert (await r.json())["action"] == "inspect"
    assert passes() == 1
    assert await _last_used(store, secret) is not None
    r = await client.get("/api/v1/agent/next", headers=agent)
    assert r.status == 200 and passes() == 0  # used already: nothing to write

    # A refused first request (a route an agent may not call) is a use too.
    with store.session() as s:
        _row, fresh = issue_token(s, name="agent", role=Role.AGENT, scope=[target.machine_id])
    r = await client.post("/api/v1/claims", json={}, headers={"Authorization": f"Bearer {fresh}"})
    assert r.status == 403
    assert await _last_used(store, fresh) is not None


async def test_the_plan_waits_for_the_bmc_reading_in_every_answer(api) -> None:  # type: ignore[no-untyped-def]
    """With bmc-sel, no answer carries the plan before metald stored its first reading of the
    BMC's event log: the agent must ask the plan endpoint, which waits for it."""
    client, _tokens, store = api
    prof = CommissioningProfile(
        name="sel", checks=[CheckSpec(name="smart", timeout_s=60), CheckSpec(name="bmc-sel")]
    )
    target, secret = await _inspecting(client, store, prof)
    agent = {"Authorization": f"Bearer {secret}"}
    r = await client.post(
        "/api/v1/agent/inventory",
        json=payload(target.machine_id, boot_id=str(uuid.uuid4())),
        headers=agent,
    )
    nxt = (await r.json())["next"]
    assert nxt["action"] == "commission" and "plan" not in nxt
    r = await client.get("/api/v1/agent/next", headers=agent)
    assert (await r.json())["plan"] is None
    # No BMC service here: the reading is stored at once (as an error the run will carry).
    r = await client.get("/api/v1/agent/commissioning", headers=agent)
    assert r.status == 200, await r.text()
    plan = await r.json()
    r = await client.get("/api/v1/agent/next", headers=agent)
    assert (await r.json())["plan"] == plan


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # SQLite's planner: no statistics
async def test_a_machines_running_run_is_found_through_its_machine(api) -> None:  # type: ignore[no-untyped-def]
    """Every agent request of a commissioning machine looks up its running run. Through the
    status index that read every running run (1,000 in a storm: quadratic); through the
    machine's index it reads the machine's own."""
    from sqlalchemy import event as sa_event

    from metald.provision import commissioning

    _client, _tokens, store = api
    seen: list[tuple[str, Any]] = []

    def on(_conn: Any, _cur: Any, statement: str, params: Any, *_a: Any) -> None:
        if "FROM commissioning_runs" in statement:
            seen.append((statement, params))

    sa_event.listen(store.engine, "before_cursor_execute", on)
    try:
        with store.session() as s:
            commissioning.current_run(s, "some-machine")
    finally:
        sa_event.remove(store.engine, "before_cursor_execute", on)
    ((statement, params),) = seen
    with store.engine.connect() as c:
        plan = c.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params).fetchall()
    detail = " ".join(str(row[-1]) for row in plan)
    assert "ix_commissioning_runs_machine_status" in detail, detail
