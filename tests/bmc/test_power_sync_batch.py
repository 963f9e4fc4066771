"""Power sync records a round's readings in batches: a round over BMCs whose power did not move
costs a read of their states per ``RECORD_BATCH``, not a transaction a BMC (at 10,000 BMCs the
per-BMC transactions were most of an idle fleet's store work: bench/FLEET.md), and what did
move is recorded as before: the new state, a drift event unless metald's own command explains
it, and nothing from a reading that a later power command of metald's supersedes.

The store is real (SQLite and PostgreSQL); the BMCs stand in as a table of the power each
reports, since what is pinned is the store's side (the read path against real BMCs:
``tests/bmc/test_bmc_service.py``, ``test_power_sync_reports_drift_not_our_own_commands``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from sqlalchemy import event
from sqlmodel import Session, select

from metald.bmc import power_sync
from metald.bmc.base import PowerState
from metald.bmc.control import Expected
from metald.bmc.power_sync import PowerSync
from metald.store.db import Store
from metald.store.models import Bmc, Event, utcnow

GRACE_S = 120.0


class _Control:
    """The executor as power sync uses it; ``reports`` is each BMC's answer to a power read,
    and a read of a BMC in ``held`` waits for ``release``."""

    def __init__(self, store: Store, reports: dict[str, PowerState]) -> None:
        self.store = store
        self.reports = reports
        self.ownership = None
        self.instance = "test"
        self.expected: dict[str, Expected] = {}
        self.cfg = SimpleNamespace(drift_grace_s=GRACE_S)
        self.held: set[str] = set()
        self.release = asyncio.Event()
        self.asked: set[str] = set()

    async def sync_ownership(self) -> None:
        return None

    def owns(self, row: Bmc) -> bool:
        return True

    async def run(self, row: Bmc, op: str, fn: Callable[[Any], Awaitable[Any]]) -> PowerState:
        self.asked.add(row.id)
        if row.id in self.held:
            await self.release.wait()
        return self.reports[row.id]


async def _bmcs(store: Store, n: int, state: str | None) -> list[str]:
    def do(s: Session) -> list[str]:
        rows = [
            Bmc(
                address=f"10.9.{i // 250}.{i % 250 + 1}",
                protocol="ipmi",
                username="admin",
                password_enc=b"x",
                power_state=state,
                last_seen_at=None if state is None else utcnow(),
            )
            for i in range(n)
        ]
        s.add_all(rows)
        s.commit()
        return [r.id for r in rows]

    return await store.run(do)


async def _states(store: Store) -> dict[str, str | None]:
    return await store.run(
        lambda s: {r[0]: r[1] for r in s.execute(select(Bmc.id, Bmc.power_state))}
    )


async def _drifts(store: Store) -> list[Event]:
    return await store.run(
        lambda s: list(s.exec(select(Event).where(Event.kind == "bmc.power-drift")).all())
    )


def _count_transactions(store: Store) -> dict[str, int]:
    seen = {"begin": 0, "commit": 0}

    def begin(conn: Any) -> None:
        seen["begin"] += 1

    def commit(conn: Any) -> None:
        seen["commit"] += 1

    event.listen(store.engine, "begin", begin)
    event.listen(store.engine, "commit", commit)
    return seen


async def test_a_round_where_nothing_moved_reads_in_batches_and_commits_nothing(
    store: Store,
) -> None:
    n = 2 * power_sync.RECORD_BATCH + 88  # three batches
    ids = await _bmcs(store, n, "on")
    ctl = _Control(store, dict.fromkeys(ids, PowerState.ON))
    sync = PowerSync(ctl, interval_s=60, actor="metald:test")  # type: ignore[arg-type]
    seen = _count_transactions(store)
    assert await sync.sync_power_once() == 0
    assert ctl.asked == set(ids)
    # One transaction to list the BMCs and one per batch of readings; the old code opened one
    # per BMC (600 here).
    assert seen["begin"] <= 1 + 3, seen
    assert seen["commit"] == 0, seen
    assert set((await _states(store)).values()) == {"on"}


async def test_what_moved_is_recorded_with_drift_unless_metald_asked_for_it(
    store: Store,
) -> None:
    ids = await _bmcs(store, power_sync.RECORD_BATCH + 10, "on")
    fresh = (await _bmcs(store, 1, None))[0]  # never read: no state yet, so no drift
    ids_all = [*ids, fresh]
    reports = dict.fromkeys(ids_all, PowerState.ON)
    drifted, ours = ids[3], ids[-2]  # one in each batch
    reports[drifted] = reports[ours] = PowerState.OFF
    ctl = _Control(store, reports)
    # metald itself powered ``ours`` off a moment ago: its reading is that command taking effect.
    ctl.expected[ours] = Expected(PowerState.OFF, time.monotonic() - 1 + GRACE_S)
    sync = PowerSync(ctl, interval_s=60, actor="metald:test")  # type: ignore[arg-type]
    # ``fresh`` has never been seen: the round verifies it first; stand that in as done.
    sync.verify = _verified  # type: ignore[method-assign]
    assert await sync.sync_power_once() == 1
    states = await _states(store)
    assert states[drifted] == "off" and states[ours] == "off" and states[fresh] == "on"
    assert {k for k, v in states.items() if v != "on"} == {drifted, ours}
    events = await _drifts(store)
    assert [(e.data["bmc_id"], e.from_state, e.to_state, e.actor) for e in events] == [
        (drifted, "on", "off", "metald:test")
    ]
    # A second round with nothing new records nothing new.
    assert await sync.sync_power_once() == 0
    assert len(await _drifts(store)) == 1


async def _verified(row: Bmc) -> bool:
    return True


async def test_a_reading_older_than_metalds_next_power_command_is_not_recorded(
    store: Store,
) -> None:
    """A reading asked for before metald sent a power command, recorded after it: the BMC's
    answer may predate the command, and recording it would overwrite what the command's
    confirmation records. Recorded at once, as the old code did, the window was a store
    round-trip; in a batch it is up to the round's slowest BMC, so the batch drops it."""
    ids = await _bmcs(store, 3, "off")
    target, slow = ids[0], ids[1]
    reports = dict.fromkeys(ids, PowerState.OFF)
    reports[target] = PowerState.OFF  # still off when read: the power-on comes after
    ctl = _Control(store, reports)
    ctl.held = {target, slow}
    sync = PowerSync(ctl, interval_s=60, actor="metald:test")  # type: ignore[arg-type]
    round_ = asyncio.create_task(sync.sync_power_once())
    while ctl.asked != set(ids):
        await asyncio.sleep(0.01)
    # metald powers ``target`` on now (its confirmation records "on"), while the round's
    # reading of it, asked for before, is still on its way.
    ctl.expected[target] = Expected(PowerState.ON, time.monotonic() + GRACE_S)
    await store.run(_set_on, target)
    # ``slow`` drifted to on behind metald's back; its reading is recorded as usual.
    reports[slow] = PowerState.ON
    ctl.release.set()
    assert await round_ == 1
    states = await _states(store)
    assert states[target] == "on"  # not overwritten by the older "off"
    assert states[slow] == "on"
    assert [e.data["bmc_id"] for e in await _drifts(store)] == [slow]


def _set_on(s: Session, bmc_id: str) -> None:
    row = s.get(Bmc, bmc_id)
    assert row is not None
    row.power_state = "on"
    s.add(row)
    s.commit()
