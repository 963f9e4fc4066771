"""The watchdog: no machine stays in a transitional state forever.

Every sweep moves machines that have been in a state of ``lifecycle.TIMEOUTS`` longer than its
configured timeout to the matching failed state (a ``watchdog.timeout`` event beside the
transition), provisions claimed machines that never started (metald stopped between claim
and provision), and power-cycles provisioning or wiping machines whose network boot was never
asked for (metald stopped between the transition and the BMC call). Safe with several metald instances on one database: each move is a
compare-and-swap, so a machine is moved once whoever sweeps first.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta
from typing import Any

from sqlmodel import Session, col, select

from metald import machines
from metald.config import ProvisionConfig
from metald.lifecycle import AGENT_OPERATIONS as BOOTING_STATES
from metald.lifecycle import TIMEOUTS, IllegalTransition, State
from metald.provision import driver
from metald.service import cancel
from metald.store.db import Store
from metald.store.models import Event, Machine, as_utc, utcnow

log = logging.getLogger(__name__)


def timeouts(cfg: ProvisionConfig) -> dict[State, int]:
    """Seconds allowed in each watched state (states with 0 are not watched)."""
    out = {
        State.INSPECTING: cfg.inspecting_timeout_s,
        State.PROVISIONING: cfg.provisioning_timeout_s,
        State.JOINING: cfg.joining_timeout_s,
        State.WIPING: cfg.wiping_timeout_s,
    }
    assert set(out) == set(TIMEOUTS), "a watched state has no timeout setting"
    return {s: t for s, t in out.items() if t > 0}


def overdue(rows: list[Machine], limits: dict[State, int], now: datetime) -> list[Machine]:
    """Pure: the machines past their state's limit."""
    return [
        m
        for m in rows
        if State(m.state) in limits
        and now - as_utc(m.state_changed_at) > timedelta(seconds=limits[State(m.state)])
    ]


def sweep(
    session: Session,
    limits: dict[State, int],
    *,
    actor: str,
    now: datetime | None = None,
    instance: str | None = None,
) -> list[str]:
    """Move every overdue machine to its failed state. Returns the ids moved."""
    now = now or utcnow()
    rows = session.exec(
        select(Machine).where(col(Machine.state).in_([s.value for s in limits]))
    ).all()
    # Plain values: a lost race rolls the session back, which expires the rows read here.
    due = [(m.id, State(m.state), m.version, m.tenant_id) for m in overdue(list(rows), limits, now)]
    moved = []
    for mid, state, version, tenant_id in due:
        limit = limits[state]
        reason = f"stuck in {state.value} for more than {limit} s (watchdog)"
        try:
            machines.transition(
                session,
                mid,
                TIMEOUTS[state],
                actor=actor,
                reason=reason,
                expected_version=version,
                updates={"last_error": reason},
                instance=instance,
                commit=False,
            )
        except (machines.ConcurrentUpdate, IllegalTransition):
            session.rollback()  # another instance or the agent got there first
            continue
        machines.add_event(
            session,
            "watchdog.timeout",
            actor,
            machine_id=mid,
            tenant_id=tenant_id,
            from_state=state.value,
            reason=reason,
            data={"timeout_s": limit},
            instance=instance,
        )
        session.commit()
        moved.append(mid)
    return moved


def stalled_claims(session: Session, after_s: int, now: datetime | None = None) -> list[str]:
    """Claimed machines that have waited ``after_s`` seconds without provisioning starting."""
    now = now or utcnow()
    rows = session.exec(
        select(Machine).where(
            Machine.state == State.CLAIMED.value, col(Machine.claim_id).is_not(None)
        )
    ).all()
    return [m.id for m in rows if now - as_utc(m.state_changed_at) > timedelta(seconds=after_s)]


def interrupted_boots(session: Session, after_s: int, now: datetime | None = None) -> list[str]:
    """Provisioning/wiping machines, in that state for more than ``after_s`` seconds, with no
    sign since they entered it that their network boot was asked for (no network-boot or no-bmc
    note from the driver, no agent progress): a restart cut the driver off before the BMC call.
    Each is resumed once: the resumed boot leaves its note."""
    now = now or utcnow()
    rows = session.exec(
        select(Machine).where(col(Machine.state).in_([s.value for s in BOOTING_STATES]))
    ).all()
    waiting = {
        m.id: as_utc(m.state_changed_at)
        for m in rows
        if now - as_utc(m.state_changed_at) > timedelta(seconds=after_s)
    }
    if not waiting:
        return []
    since = min(waiting.values())
    handled = session.exec(
        select(Event.machine_id, Event.at).where(
            col(Event.machine_id).in_(list(waiting)),
            col(Event.kind).in_(driver.BOOT_HANDLED_EVENTS),
            col(Event.at) >= since,
        )
    ).all()
    for mid, at in handled:
        if mid in waiting and as_utc(at) >= waiting[mid]:
            del waiting[mid]
    return sorted(waiting)


class Watchdog:
    """The sweep as a daemon service. ``services`` is the daemon's registry (for the BMC)."""

    name = "watchdog"

    def __init__(
        self,
        store: Store,
        cfg: ProvisionConfig,
        instance: str,
        services: dict[str, Any] | None = None,
    ) -> None:
        self.store = store
        self.cfg = cfg
        self.instance = instance
        self.actor = f"metald:{instance}"
        self.services = services if services is not None else {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.cfg.watchdog_interval_s > 0:
            self._task = asyncio.create_task(self._loop(), name="provision-watchdog")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
        await driver.cancel_all()

    async def sweep_once(self) -> list[str]:
        """One sweep: time out stuck machines, resume stalled claims. Returns ids touched."""
        moved = await self.store.run(
            sweep, timeouts(self.cfg), actor=self.actor, instance=self.instance
        )
        resumed: list[str] = []
        bmc = self.services.get("bmc") if self.cfg.use_bmc else None
        if self.cfg.claimed_resume_s > 0:
            stalled = await self.store.run(stalled_claims, self.cfg.claimed_resume_s)
            resumed = await self.store.run(
                driver.start_provisioning, stalled, actor=self.actor, instance=self.instance
            )
        if self.cfg.claimed_resume_s > 0 and bmc is not None:
            # Resumed claims were just moved to provisioning: they boot below, once.
            cut_off = await self.store.run(interrupted_boots, self.cfg.claimed_resume_s)
            cut_off = [m for m in cut_off if m not in resumed]
            for mid in cut_off:
                log.warning("machine %s: resuming a network boot a restart cut off", mid)
            resumed += cut_off
        await driver.reboot_all(self.store, bmc, resumed, actor=self.actor, instance=self.instance)
        return moved + resumed

    async def _loop(self) -> None:
        while True:
            try:
                await self.sweep_once()
            except Exception:
                log.exception("watchdog sweep failed; trying again next interval")
            await asyncio.sleep(self.cfg.watchdog_interval_s)
