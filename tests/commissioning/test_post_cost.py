"""What one result post costs the store: a fixed handful of statements, the same for every post
whatever the run already holds, and never a read of earlier results' values or raw output (the
1,000-machine storm's 2,000 result posts queue on SQLite's single writer: every statement of a
post is paid 2,000 times in a burst)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event

from metald.commissioning.profile import CheckSpec, CommissioningProfile
from tests.commissioning.test_api import FIO_OK, _inventoried, report

#: A post that is not the last (one result): BEGIN, read the machine, its running run and the
#: run's verdicts so far (check, status, sentence), insert the result and its event. The old code
#: read the machine twice and every earlier result whole (raw output included), and opened a
#: second write transaction after the commit to read the machine's state again: 9.
MIDDLE_POST = 6
#: The last post also updates the run and the machine (the transition) and adds its event, and
#: reads whether a repair waits for this verdict (one indexed read of the machine's open repair,
#: ``metald.repairs.verification_ended``); the old code read every result again, raw output
#: included: 12. A failing verdict with no repair waiting reads whether the machine passed a run
#: before (one indexed read: a machine from the pool goes to the repair queue): 11.
LAST_POST = 11


@contextmanager
def counted(store: Any) -> Iterator[list[str]]:
    seen: list[str] = []

    def on(_conn: Any, _cur: Any, statement: str, *_a: Any) -> None:
        seen.append(statement)

    event.listen(store.engine, "before_cursor_execute", on)
    try:
        yield seen
    finally:
        event.remove(store.engine, "before_cursor_execute", on)


def _without_auth(statements: list[str]) -> list[str]:
    """The statements after the agent token's lookup (the same for every agent request, not
    commissioning's)."""
    i = next(i for i, x in enumerate(statements) if "api_tokens" in x)
    return statements[i + 1 :]


async def test_a_result_post_costs_a_fixed_handful_of_statements(api) -> None:  # type: ignore[no-untyped-def]
    client, _tokens, store = api
    prof = CommissioningProfile(
        name="cost",
        gpu_model="*H100*",
        checks=[
            CheckSpec(name="smart", timeout_s=60),
            CheckSpec(name="memtester", timeout_s=60),
            CheckSpec(name="fio", timeout_s=60),
        ],
    )
    _target, agent = await _inventoried(client, store, prof)
    # One check twice in one post is a second report: refused, nothing recorded.
    twice = {"results": [report("smart", "{}"), report("smart", "{}")]}
    r = await client.post("/api/v1/agent/commissioning", json=twice, headers=agent)
    assert r.status == 409 and "already reported" in (await r.json())["detail"]
    posts = []
    for name, raw in (("smart", "{}"), ("memtester", "x" * 60000), ("fio", FIO_OK)):
        with counted(store) as seen:
            r = await client.post(
                "/api/v1/agent/commissioning", json={"results": [report(name, raw)]}, headers=agent
            )
            assert r.status == 200, await r.text()
        posts.append(_without_auth(seen))
    body = await r.json()
    assert body["status"] == "failed" and body["state"] == "commission-failed"
    begin = 1 if store.is_sqlite else 0  # PostgreSQL's BEGIN is not a cursor statement
    # The second post costs what the first did: nothing grows with the results already in.
    assert len(posts[0]) == len(posts[1]) == MIDDLE_POST - 1 + begin, posts[1]
    assert len(posts[2]) == LAST_POST - 1 + begin, posts[2]
    for st in posts[1] + posts[2]:
        if st.lstrip().upper().startswith("SELECT"):
            assert "raw" not in st and "values" not in st, st  # no earlier output read back
