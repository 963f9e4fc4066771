"""The watchdog: no machine stays in a transitional state forever.

Every sweep moves machines that have been in a state of ``lifecycle.TIMEOUTS`` longer than its
configured timeout to the matching failed state (a ``watchdog.timeout`` event beside the
transition), provisions claimed machines that never started (metald stopped between claim
and provision), and power-cycles provisioning or wiping machines whose network boot was never
asked for (metald stopped between the transition and the BMC call), and resumes provisioning
steps the BMC's journal shows unfinished (an instance killed mid-step, or a step handed to the
BMC's owner by the instance that received the request).

With several instances each machine is swept by one of them: the owner of its BMC, or for a
machine without a BMC the rendezvous owner of ``machine:<id>`` (``Membership.owns_machine``).
Each move is a compare-and-swap besides, so a machine is moved once whoever sweeps first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlmodel import Session, col, select

from metald import machines
from metald.bmc import ownership
from metald.bmc.control import step_key
from metald.config import ProvisionConfig
from metald.lifecycle import AGENT_OPERATIONS as BOOTING_STATES
from metald.lifecycle import TIMEOUTS, IllegalTransition, State
from metald.provision import driver
from metald.service import cancel
from metald.store.db import Store
from metald.store.models import Bmc, Event, Machine, as_utc, utcnow

#: Whether this instance sweeps a machine: (machine id, its BMC's (id, address) or None).
Owns = Callable[[str, tuple[str, str] | None], bool]


def _owned(session: Session, machine_ids: list[str], owns: Owns | None) -> set[str]:
    """The machines of ``machine_ids`` this instance sweeps (all of them without a fleet)."""
    if owns is None or not machine_ids:
        return set(machine_ids)
    bmcs: dict[str, tuple[str, str]] = {}
    for i in range(0, len(machine_ids), 500):
        for mid, bid, addr in session.exec(
            select(Bmc.machine_id, Bmc.id, Bmc.address).where(
                col(Bmc.machine_id).in_(machine_ids[i : i + 500])
            )
        ).all():
            if mid is not None:
                bmcs[mid] = (bid, addr)
    return {m for m in machine_ids if owns(m, bmcs.get(m))}


log = logging.getLogger(__name__)


def timeouts(cfg: ProvisionConfig) -> dict[State, int]:
    """Seconds allowed in each watched state (states with 0 are not watched)."""
    out = {
        State.INSPECTING: cfg.inspecting_timeout_s,
        State.COMMISSIONING: cfg.commissioning_timeout_s,
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
    owns: Owns | None = None,
) -> list[str]:
    """Move every overdue machine (of those this instance sweeps) to its failed state.
    Returns the ids moved."""
    now = now or utcnow()
    rows = session.exec(
        select(Machine).where(col(Machine.state).in_([s.value for s in limits]))
    ).all()
    # Plain values: a lost race rolls the session back, which expires the rows read here.
    due = [(m.id, State(m.state), m.version, m.tenant_id) for m in overdue(list(rows), limits, now)]
    mine = _owned(session, [d[0] for d in due], owns)
    due = [d for d in due if d[0] in mine]
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


def stalled_claims(
    session: Session, after_s: int, now: datetime | None = None, owns: Owns | None = None
) -> list[str]:
    """Claimed machines that have waited ``after_s`` seconds without provisioning starting."""
    now = now or utcnow()
    rows = session.exec(
        select(Machine).where(
            Machine.state == State.CLAIMED.value, col(Machine.claim_id).is_not(None)
        )
    ).all()
    ids = [m.id for m in rows if now - as_utc(m.state_changed_at) > timedelta(seconds=after_s)]
    mine = _owned(session, ids, owns)
    return [m for m in ids if m in mine]


def interrupted_boots(
    session: Session, after_s: int, now: datetime | None = None, owns: Owns | None = None
) -> list[str]:
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
    mine = _owned(session, list(waiting), owns)
    return sorted(m for m in waiting if m in mine)


def unfinished_steps(session: Session, owns_bmc: Callable[[str, str], bool] | None) -> list[str]:
    """Machines whose current network-boot step the journal of a BMC this instance owns
    (``owns_bmc``; all without a fleet) shows begun, or handed over, but not finished. Journals
    of steps the machine has left are closed on the way."""
    out = []
    for mid, bid, address, step in ownership.unfinished_steps(session):
        if owns_bmc is not None and not owns_bmc(bid, address):
            continue
        m = session.get(Machine, mid)
        if m is not None and State(m.state) in driver.NETWORK_BOOT_STATES and step_key(m) == step:
            out.append(mid)
        else:
            ownership.mark_step(session, mid, step, command=None, done=True)
    return sorted(out)


class Watchdog:
    """The sweep as a daemon service. ``services`` is the daemon's registry (for the BMC).

    ``ownership`` (the fleet's Membership) splits the sweep across instances; without it this
    instance sweeps everything. Unfinished steps are resumed every ``resume_interval_s`` (the
    heartbeat, in the daemon), the full sweep runs every ``watchdog_interval_s``; ``wake``
    runs both now (the live set changed: a dead instance's BMCs have a new owner)."""

    name = "watchdog"

    def __init__(
        self,
        store: Store,
        cfg: ProvisionConfig,
        instance: str,
        services: dict[str, Any] | None = None,
        *,
        ownership: Any = None,
        resume_interval_s: float | None = None,
    ) -> None:
        self.store = store
        self.cfg = cfg
        self.instance = instance
        self.actor = f"metald:{instance}"
        self.services = services if services is not None else {}
        self.ownership = ownership
        self.resume_interval_s = resume_interval_s or cfg.watchdog_interval_s
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def wake(self) -> None:
        self._wake.set()

    async def start(self) -> None:
        if self.cfg.watchdog_interval_s > 0:
            self._task = asyncio.create_task(self._loop(), name="provision-watchdog")

    async def stop(self) -> None:
        # The sweep awaits its own steps: cancelling its task stops them. Steps the API started
        # belong to the Provisioner service, which stops them itself.
        await cancel(self._task)
        self._task = None

    def _owns(self) -> Owns | None:
        own = self.ownership
        return None if own is None else own.owns_machine

    def _bmc(self) -> Any:
        return self.services.get("bmc") if self.cfg.use_bmc else None

    async def resume_once(self) -> list[str]:
        """Resume the unfinished steps of the BMCs this instance holds."""
        bmc = self._bmc()
        if bmc is None or (self.ownership is not None and self.ownership.fenced):
            return []
        control = driver.control_of(bmc)
        busy = getattr(control, "in_flight", set())
        owns_bmc = None if self.ownership is None else self.ownership.owns_bmc
        todo = [m for m in await self.store.run(unfinished_steps, owns_bmc) if m not in busy]
        for mid in todo:
            log.warning("machine %s: resuming an unfinished network-boot step", mid)
        await driver.reboot_all(self.store, bmc, todo, actor=self.actor, instance=self.instance)
        return todo

    async def sweep_once(self) -> list[str]:
        """One sweep: time out stuck machines, resume stalled claims. Returns ids touched."""
        if self.ownership is not None and self.ownership.fenced:
            return []
        owns = self._owns()
        moved = await self.store.run(
            sweep, timeouts(self.cfg), actor=self.actor, instance=self.instance, owns=owns
        )
        resumed: list[str] = []
        bmc = self._bmc()
        if self.cfg.claimed_resume_s > 0:
            stalled = await self.store.run(stalled_claims, self.cfg.claimed_resume_s, None, owns)
            resumed = await self.store.run(
                driver.start_provisioning, stalled, actor=self.actor, instance=self.instance
            )
        if self.cfg.claimed_resume_s > 0 and bmc is not None:
            # Resumed claims were just moved to provisioning: they boot below, once.
            cut_off = await self.store.run(interrupted_boots, self.cfg.claimed_resume_s, None, owns)
            cut_off = [m for m in cut_off if m not in resumed]
            for mid in cut_off:
                log.warning("machine %s: resuming a network boot a restart cut off", mid)
            resumed += cut_off
        await driver.reboot_all(self.store, bmc, resumed, actor=self.actor, instance=self.instance)
        return moved + resumed + await self.resume_once()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_full = loop.time()
        while True:
            full = loop.time() >= next_full or self._wake.is_set()
            self._wake.clear()
            try:
                if full:
                    next_full = loop.time() + self.cfg.watchdog_interval_s
                    await self.sweep_once()
                else:
                    await self.resume_once()
            except Exception:
                log.exception("watchdog sweep failed; trying again next interval")
            wait = min(self.resume_interval_s, max(0.0, next_full - loop.time()))
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass
