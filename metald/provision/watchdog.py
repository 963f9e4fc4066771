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

from sqlalchemy import update
from sqlalchemy.orm import load_only
from sqlmodel import Session, col, select

from metald import machines, repairs
from metald.auth import revoke_machine_tokens
from metald.bmc import ownership
from metald.bmc.control import step_key, step_key_of
from metald.config import ProvisionConfig
from metald.lifecycle import AGENT_OPERATIONS as BOOTING_STATES
from metald.lifecycle import COMMISSION_RUNNING, TIMEOUTS, UNINSPECTED, IllegalTransition, State
from metald.provision import netboot, netboot_core
from metald.provision.boots import REFETCH_EVENT, arm_boot
from metald.service import TaskScope, cancel
from metald.store.db import Store
from metald.store.models import ApiToken, Bmc, Event, Lease, Machine, Nic, as_utc, utcnow

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
#: Operations whose timeout fails a repaired machine's verification (it is inspected, then
#: commissioned); a wipe's timeout does not (the wipe is retried, the repair waits).
VERIFIES_REPAIR = (UNINSPECTED | COMMISSION_RUNNING) & TIMEOUTS.keys()


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


#: Why a network boot that never fetched its script stopped, as the timeout's event says it.
UNFETCHED = (
    "its network boot never fetched its iPXE script: the machine did not boot from the "
    "network, or its iPXE could not reach metald's boot URL or refused the certificate it "
    "was shown there (metald's iPXE trusts only metald's CA: another server answering "
    "metald's address on the provisioning network gets no request)"
)


def unfetched_boot(m: Machine) -> bool:
    """Pure: the machine's current network boot was armed and its script never fetched (the
    fetch takes the armed nonce; a virtual-media boot's too)."""
    return bool(m.boot_armed) and State(m.state) in netboot.NETWORK_BOOT_STATES


#: The columns a sweep decides on. Every instance's watchdog reads every machine in a watched
#: state each pass: the whole row (inventory, labels, BIOS and boot intent, all JSON) made the
#: pass cost grow with the machines in flight, and the passes with the phase's length: at
#: 10,000 machines (bench/fleet.py, 3,200 provisioning) decoding those rows was 14 % of an
#: instance's CPU in the claims phase. A machine that is moved is read whole by ``transition``.
_SWEPT_COLUMNS = load_only(
    Machine.id,  # type: ignore[arg-type]
    Machine.state,  # type: ignore[arg-type]
    Machine.state_changed_at,  # type: ignore[arg-type]
    Machine.version,  # type: ignore[arg-type]
    Machine.tenant_id,  # type: ignore[arg-type]
    Machine.boot_armed,  # type: ignore[arg-type]
)


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
        select(Machine)
        .where(col(Machine.state).in_([s.value for s in limits]))
        .options(_SWEPT_COLUMNS)
    ).all()
    # Plain values: a lost race rolls the session back, which expires the rows read here.
    due = [
        (m.id, State(m.state), m.version, m.tenant_id, unfetched_boot(m))
        for m in overdue(list(rows), limits, now)
    ]
    mine = _owned(session, [d[0] for d in due], owns)
    due = [d for d in due if d[0] in mine]
    moved = []
    for mid, state, version, tenant_id, unfetched in due:
        limit = limits[state]
        reason = f"stuck in {state.value} for more than {limit} s (watchdog)"
        if unfetched:
            reason += f"; {UNFETCHED}"
        try:
            m = machines.transition(
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
            if state in VERIFIES_REPAIR:
                # A machine back from repair that never finished its inspection or
                # commissioning failed its verification.
                repairs.verification_ended(
                    session, m, passed=False, why=reason, actor=actor, instance=instance
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
            data={"timeout_s": limit, "script_fetched": not unfetched},
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
    note from the driver, no agent progress, and no step of this state entry in their BMC's
    journal): a restart cut the driver off before the BMC call. Each is resumed once: the
    resumed boot leaves its note.

    A journaled step (``requested`` by an instance that does not hold the BMC, or a command
    under way) is the BMC holder's to run or resume (``unfinished_steps``), however long its
    queue: counted here as well, every sweep of a 10,000-machine fleet with 8,000 claimed
    machines resumed thousands of boots already asked for (28,500 in 7 minutes on four
    instances, bench/FLEET.md), each a driver run of store reads that decided nothing."""
    now = now or utcnow()
    rows = session.exec(
        select(Machine.id, Machine.state, Machine.state_changed_at).where(
            col(Machine.state).in_([s.value for s in BOOTING_STATES])
        )
    ).all()
    waiting = {
        mid: as_utc(changed)
        for mid, _state, changed in rows
        if now - as_utc(changed) > timedelta(seconds=after_s)
    }
    if not waiting:
        return []
    steps = {mid: step_key_of(state, changed) for mid, state, changed in rows if mid in waiting}
    journaled = session.exec(
        select(Bmc.machine_id, Bmc.step).where(
            col(Bmc.machine_id).in_(list(waiting)), col(Bmc.step).is_not(None)
        )
    ).all()
    for mid, step in journaled:
        if mid is not None and steps.get(mid) == step:
            del waiting[mid]
    if not waiting:
        return []
    since = min(waiting.values())
    handled = session.exec(
        select(Event.machine_id, Event.at).where(
            col(Event.machine_id).in_(list(waiting)),
            col(Event.kind).in_(netboot.BOOT_HANDLED_EVENTS),
            col(Event.at) >= since,
        )
    ).all()
    for mid, at in handled:
        if mid in waiting and as_utc(at) >= waiting[mid]:
            del waiting[mid]
    mine = _owned(session, list(waiting), owns)
    return sorted(m for m in waiting if m in mine)


#: How many times one operation's (one state entry's) stranded boot is started again.
MAX_REARMS = 3
REARM_EVENT = "boot.rearmed"
STRANDED_EVENT = "boot.stranded"


def stranded_boots(
    session: Session, after_s: int, now: datetime | None = None, owns: Owns | None = None
) -> list[tuple[str, str]]:
    """(machine id, boot) of network-booting machines whose boot's token was taken by a script
    fetch more than ``after_s`` seconds ago and never used by any agent call: the script's
    answer was lost (its instance died as it answered), and every later fetch of that boot gets
    no token, so the machine would sit until its state's timeout."""
    now = now or utcnow()
    cutoff = now - timedelta(seconds=after_s)
    rows = session.exec(
        select(Machine.id, Machine.boot_current, ApiToken.created_at)
        .join(ApiToken, col(ApiToken.machine_id) == col(Machine.id))
        .where(
            col(Machine.state).in_([s.value for s in netboot.NETWORK_BOOT_STATES]),
            col(Machine.boot_armed).is_(None),
            col(Machine.boot_current).is_not(None),
            col(ApiToken.boot) == col(Machine.boot_current),
            col(ApiToken.revoked_at).is_(None),
            col(ApiToken.last_used_at).is_(None),
        )
    ).all()
    old = {mid: (boot, as_utc(created)) for mid, boot, created in rows if as_utc(created) < cutoff}
    found = {
        mid: boot
        for mid, (boot, minted) in old.items()
        if boot and not _running_since(session, mid, boot, minted)
    }
    mine = _owned(session, list(found), owns)
    return sorted((m, found[m]) for m in found if m in mine)


def _running_since(session: Session, machine_id: str, boot: str, minted: datetime) -> bool:
    """Whether the machine shows that its script reached it although its agent has not used the
    token yet (slow, not stranded): one of its NICs did a DHCP exchange after the token was
    handed out (what the script booted asking for its address), and it did not ask for its
    script again in this boot (a machine whose answer was lost asks again, or falls silent).

    Under a storm on a starved box the agent's first call can come minutes after its script:
    counting such a machine stranded revoked its token and booted it again, redoing its whole
    boot and adding work to the storm that slowed it (the 10,000-machine run of issue 33:
    1,080 re-armed boots in one minute against 210 state changes)."""
    refetched = session.exec(
        select(Event.data).where(Event.machine_id == machine_id, Event.kind == REFETCH_EVENT)
    ).all()
    if any((d or {}).get("boot") == boot for d in refetched):
        return False
    last = session.exec(
        select(Lease.updated_at)
        .where(col(Lease.mac).in_(select(Nic.mac).where(Nic.machine_id == machine_id)))
        .order_by(col(Lease.updated_at).desc())
        .limit(1)
    ).first()
    return last is not None and as_utc(last) > minted


def rearm_stranded(
    session: Session,
    machine_id: str,
    boot: str,
    *,
    actor: str,
    instance: str | None,
    can_boot: bool = True,
) -> str | None:
    """Hand a stranded boot back to the BMC: its unused token is revoked and the machine's
    network-boot step is marked to be done again (power off confirmed, one-time PXE, a new
    armed boot, power on: ``netboot.boot_from_network``), with a ``boot.rearmed`` event:
    returns ``"bmc"``.

    A machine in its first inspection (``inspecting``, no inventory yet, so no BMC linked: the
    inventory is what links it) has no BMC to boot it; its boot is armed again in the store
    instead, as entering inspection armed the first one (``lifecycle.ARM_ON_ENTRY``), so the
    machine's next network boot (its firmware retrying, a person powering it on) gets a token:
    returns ``"armed"``. It was never inspected, so it holds nothing of a tenant's, and the new
    boot is no more exposed than the first one was.

    None (nothing changed) when the boot moved on meanwhile, when the machine has no BMC (and is
    past its first inspection) or when this operation was started again ``MAX_REARMS`` times
    already (or ``can_boot`` is False: no BMC service here); a ``boot.stranded`` event then
    tells a technician, once per boot."""
    m = session.get(Machine, machine_id)
    if m is None or m.boot_current != boot or m.boot_armed is not None:
        return None
    entered = as_utc(m.state_changed_at)
    rearmed = [
        at
        for at in session.exec(
            select(Event.at).where(Event.machine_id == machine_id, Event.kind == REARM_EVENT)
        ).all()
        if as_utc(at) >= entered
    ]
    has_bmc = (
        can_boot
        and session.exec(select(Bmc.id).where(Bmc.machine_id == machine_id)).first() is not None
    )
    first_inspection = (
        m.state == State.INSPECTING.value
        and m.inventory is None
        and session.exec(select(Bmc.id).where(Bmc.machine_id == machine_id)).first() is None
    )
    if first_inspection and len(rearmed) < MAX_REARMS:
        arm_boot(session, machine_id)  # the unused token is revoked with the old boot
        machines.add_event(
            session,
            REARM_EVENT,
            actor,
            machine_id=machine_id,
            reason=(
                "the agent token of this boot was handed out but no agent ever used it (the "
                "script's answer was lost); no BMC is known before the first inventory, so a "
                "new boot is armed: the machine's next network boot gets a token"
            ),
            data={"boot": boot, "state": m.state, "attempt": len(rearmed) + 1, "bmc": False},
            instance=instance,
        )
        session.commit()
        return "armed"
    if has_bmc and len(rearmed) < MAX_REARMS:
        revoke_machine_tokens(session, machine_id, commit=False)
        # The step's journal says done (this boot's power-on was sent): mark it to do again.
        session.execute(
            update(Bmc)
            .where(col(Bmc.machine_id) == machine_id)
            .values(step=step_key(m), step_done=False, step_command="requested")
        )
        machines.add_event(
            session,
            REARM_EVENT,
            actor,
            machine_id=machine_id,
            tenant_id=m.tenant_id,
            reason=(
                "the agent token of this boot was handed out but no agent ever used it (the "
                "script's answer was lost); starting a new boot through the BMC"
            ),
            data={"boot": boot, "state": m.state, "attempt": len(rearmed) + 1},
            instance=instance,
        )
        session.commit()
        return "bmc"
    done = session.exec(
        select(Event.data).where(Event.machine_id == machine_id, Event.kind == STRANDED_EVENT)
    ).all()
    if any((d or {}).get("boot") == boot for d in done):
        return None
    why = (
        "it has no BMC metald can drive"
        if not has_bmc
        else f"it was started again {MAX_REARMS} times already"
    )
    machines.add_event(
        session,
        STRANDED_EVENT,
        actor,
        machine_id=machine_id,
        tenant_id=m.tenant_id,
        reason=(
            "the agent token of this boot was handed out but no agent ever used it, and metald "
            f"does not start a new boot by itself ({why}): a technician should check the "
            "machine and run the operation again, which arms a new boot"
        ),
        data={"boot": boot, "state": m.state},
        instance=instance,
    )
    session.commit()
    return None


def unfinished_steps(session: Session, owns_bmc: Callable[[str, str], bool] | None) -> list[str]:
    """Machines whose current network-boot step the journal of a BMC this instance owns
    (``owns_bmc``; all without a fleet) shows begun, or handed over, but not finished. Journals
    of steps the machine has left are closed on the way."""
    out = []
    for mid, bid, address, step in ownership.unfinished_steps(session):
        if owns_bmc is not None and not owns_bmc(bid, address):
            continue
        m = session.get(Machine, mid)
        # The stored step, fed to the step's own core: resumed unless it is one the machine
        # has left (or its state no longer boots over the network).
        booting = (
            m is not None and State(m.state) in netboot.NETWORK_BOOT_STATES and step_key(m) == step
        )
        if netboot_core.resumes(netboot_core.StepLoaded(booting=booting)):
            out.append(mid)
        else:
            ownership.mark_step(session, mid, step, command=None, done=True)
    return sorted(out)


class Watchdog:
    """The sweep as a daemon service. ``bmc`` is the daemon's BMC service (None: no BMCs).

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
        bmc: Any = None,
        *,
        ownership: Any = None,
        resume_interval_s: float | None = None,
    ) -> None:
        self.store = store
        self.cfg = cfg
        self.instance = instance
        self.actor = f"metald:{instance}"
        self.bmc = bmc
        self.ownership = ownership
        self.resume_interval_s = resume_interval_s or cfg.watchdog_interval_s
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        #: Machine id -> the step the loop started for it and that still runs.
        self._steps: dict[str, asyncio.Task[None]] = {}
        #: The task group those steps run in (opened by the first one, closed by ``stop``).
        self._scope = TaskScope("provision-watchdog-steps")

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
        steps = list(self._steps.values())
        for t in steps:
            t.cancel()
        await asyncio.gather(*steps, return_exceptions=True)
        self._steps.clear()
        await self._scope.close()

    async def _boot(self, bmc: Any, machine_ids: list[str], wait: bool) -> None:
        """Run these machines' network-boot steps. ``wait`` False (the loop): each runs as a
        task of its own and the loop goes on, so one step that waits (a BMC slow to report
        off: up to ``netboot_core.POWER_OFF_WAIT_S``) never holds back the steps of every
        other BMC this instance holds; a machine whose step still runs is not started again."""
        if wait:
            await netboot.reboot_all(
                self.store, bmc, machine_ids, actor=self.actor, instance=self.instance
            )
            return
        for mid in machine_ids:
            if mid in self._steps or bmc is None:
                continue
            if not self._scope.is_open:
                await self._scope.open()
            task = self._scope.spawn(
                netboot.reboot_all(
                    self.store, bmc, [mid], actor=self.actor, instance=self.instance
                ),
                name=f"netboot-{mid}",
            )
            self._steps[mid] = task
            task.add_done_callback(lambda t, mid=mid: self._step_done(mid, t))

    def _step_done(self, mid: str, task: asyncio.Task[None]) -> None:
        if self._steps.get(mid) is task:
            del self._steps[mid]
        if not task.cancelled() and task.exception() is not None:
            log.error("machine %s: network-boot step failed", mid, exc_info=task.exception())

    def _owns(self) -> Owns | None:
        own = self.ownership
        return None if own is None else own.owns_machine

    def _bmc(self) -> Any:
        return self.bmc if self.cfg.use_bmc else None

    async def resume_once(self, wait: bool = True) -> list[str]:
        """Resume the unfinished steps of the BMCs this instance holds (``wait``: until they
        end; else each in a task of its own, ``_boot``)."""
        bmc = self._bmc()
        if bmc is None or (self.ownership is not None and self.ownership.fenced):
            return []
        control = netboot.control_of(bmc)
        busy = getattr(control, "in_flight", set())
        owns_bmc = None if self.ownership is None else self.ownership.owns_bmc
        todo = [
            m
            for m in await self.store.run(unfinished_steps, owns_bmc)
            if m not in busy and m not in self._steps
        ]
        for mid in todo:
            log.warning("machine %s: resuming an unfinished network-boot step", mid)
        await self._boot(bmc, todo, wait)
        return todo

    async def sweep_once(self, wait: bool = True) -> list[str]:
        """One sweep: time out stuck machines, resume stalled claims. Returns ids touched.
        ``wait``: until the network-boot steps it starts end (else ``_boot``'s tasks)."""
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
                netboot.start_provisioning, stalled, actor=self.actor, instance=self.instance
            )
        if self.cfg.claimed_resume_s > 0 and bmc is not None:
            # Resumed claims were just moved to provisioning: they boot below, once.
            cut_off = await self.store.run(interrupted_boots, self.cfg.claimed_resume_s, None, owns)
            cut_off = [m for m in cut_off if m not in resumed]
            for mid in cut_off:
                log.warning("machine %s: resuming a network boot a restart cut off", mid)
            resumed += cut_off
        armed: list[str] = []
        if self.cfg.stranded_boot_s > 0:
            by_bmc, armed = await self._rearm_stranded(owns, bmc, exclude=set(resumed))
            resumed += by_bmc
        await self._boot(bmc, resumed, wait)
        return moved + resumed + armed + await self.resume_once(wait)

    async def _rearm_stranded(
        self, owns: Owns | None, bmc: Any, exclude: set[str]
    ) -> tuple[list[str], list[str]]:
        """Stranded boots (``stranded_boots``) this instance sweeps: (those marked to boot
        again through the BMC, those in their first inspection armed again in the store);
        without a BMC service (``use_bmc`` off) only the latter, and a technician is told."""
        found = await self.store.run(stranded_boots, self.cfg.stranded_boot_s, None, owns)
        by_bmc: list[str] = []
        armed: list[str] = []
        for mid, boot in found:
            if mid in exclude:
                continue
            how = await self.store.run(
                rearm_stranded,
                mid,
                boot,
                actor=self.actor,
                instance=self.instance,
                can_boot=bmc is not None,
            )
            if how == "bmc":
                log.warning("machine %s: its boot's token was never used; booting it again", mid)
                by_bmc.append(mid)
            elif how == "armed":
                log.warning(
                    "machine %s: its first inspection's token was never used and no BMC is "
                    "known yet; armed a new boot for its next network boot",
                    mid,
                )
                armed.append(mid)
        return by_bmc, armed

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_full = loop.time()
        while True:
            full = loop.time() >= next_full or self._wake.is_set()
            self._wake.clear()
            try:
                if full:
                    next_full = loop.time() + self.cfg.watchdog_interval_s
                    await self.sweep_once(wait=False)
                else:
                    await self.resume_once(wait=False)
            except Exception:
                log.exception("watchdog sweep failed; trying again next interval")
            wait = min(self.resume_interval_s, max(0.0, next_full - loop.time()))
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass
