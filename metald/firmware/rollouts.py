"""Firmware rollouts as a daemon service: machines of one profile taken into maintenance and
flashed to one baseline version in waves, stopped by a failure budget (``metald.firmware.waves``
decides; this service records and acts).

Everything a rollout is lives in the store (``firmware_rollouts``, ``firmware_rollout_targets``):
one instance drives it at a time, holding a lease it renews at every step; an instance that
dies leaves the lease to run out, and a survivor takes the rollout over from the record. Each
decision is written before it is acted on: a target is ``updating`` (its machine in
maintenance) before its updates are queued; a target found ``updating`` without updates is
queued again, one with updates follows them (``metald.firmware.service`` never flashes twice).

A machine joins a rollout only from ``ready`` or ``maintenance``, through the lifecycle's
``maintenance-on`` (so no claim takes it: claims take ``ready`` machines only), and goes back
to ``ready`` through ``maintenance-off`` once updated (a machine that was in maintenance
before stays there; a failed one stays there for a person to look at).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any, Protocol

from sqlalchemy import func, or_, update
from sqlmodel import Session, col, select

from metald.errors import Conflict, MetaldError
from metald.firmware.updates import FINAL as UPDATE_FINAL
from metald.firmware.updates import Phase
from metald.firmware.waves import (
    ENDED,
    Availability,
    InUse,
    Plan,
    Policy,
    RolloutState,
    Target,
    TargetStatus,
    plan,
)
from metald.lifecycle import ALLOCATED, ROLLOUT_FREE, ROLLOUT_GONE, State, Trigger
from metald.machines import add_event, transition
from metald.service import TaskScope, wait_event
from metald.store.db import Store
from metald.store.models import (
    Claim,
    FirmwareRollout,
    FirmwareRolloutTarget,
    FirmwareUpdate,
    Machine,
    utcnow,
)

log = logging.getLogger(__name__)

FREE_STATES = frozenset(s.value for s in ROLLOUT_FREE)
GONE_STATES = frozenset(s.value for s in ROLLOUT_GONE)
ALLOCATED_STATES = frozenset(s.value for s in ALLOCATED)


class Updater(Protocol):
    """The updates service (``metald.firmware.service.FirmwareUpdates``) as rollouts use it."""

    async def start_update(
        self,
        machine_id: str,
        *,
        components: list[str] | None,
        actor: str,
        baseline_version: int | None = None,
    ) -> list[dict[str, Any]]: ...

    async def resume(self) -> list[str]: ...


class Drainer(Protocol):
    """The Day-2 path as a rollout uses it (``metald.healthwatch.workflow.FirmwareDrain``):
    open, in the caller's transaction, the drain of a machine in use whose tenant consented;
    its id, or None when none was opened (no consent, not in use, one open already)."""

    def open(
        self, s: Session, machine_id: str, *, reason: str, actor: str, instance: str | None
    ) -> str | None: ...


class KeyOwnership(Protocol):
    def owns_key(self, key: str) -> bool: ...


def availability(state: str | None) -> Availability:
    if state is None or state in GONE_STATES:
        return Availability.GONE
    return Availability.FREE if state in FREE_STATES else Availability.BUSY


def progress(targets: list[FirmwareRolloutTarget]) -> dict[str, Any]:
    counts = {s.value: 0 for s in TargetStatus}
    for t in targets:
        counts[t.status] = counts.get(t.status, 0) + 1
    total = len(targets)
    ended = counts["done"] + counts["failed"] + counts["skipped"]
    return {
        "total": total,
        **counts,
        "percent": round(100 * ended / total) if total else 100,
        "wave": max((t.wave or 0 for t in targets), default=0),
    }


def _counts(s: Session, rollout_id: str) -> dict[str, Any]:
    """``progress`` counted by the database (an event per machine, without reading them all)."""
    rows = s.exec(
        select(FirmwareRolloutTarget.status, func.count(), func.max(FirmwareRolloutTarget.wave))
        .where(FirmwareRolloutTarget.rollout_id == rollout_id)
        .group_by(FirmwareRolloutTarget.status)
    ).all()
    counts = {st.value: 0 for st in TargetStatus}
    wave = 0
    for status, n, w in rows:
        counts[status] = int(n)
        wave = max(wave, int(w or 0))
    total = sum(counts.values())
    ended = counts["done"] + counts["failed"] + counts["skipped"]
    return {"total": total, **counts, "percent": round(100 * ended / total) if total else 100,
            "wave": wave}  # fmt: skip


def rollout_view(r: FirmwareRollout, targets: list[FirmwareRolloutTarget] | None = None,
                 *, with_targets: bool = False) -> dict[str, Any]:  # fmt: skip
    out = r.model_dump()
    if targets is not None:
        out["progress"] = progress(targets)
        if with_targets:
            out["targets"] = [t.model_dump() for t in sorted(targets, key=lambda t: t.seq)]
    return out


def targets_of(s: Session, rollout_id: str) -> list[FirmwareRolloutTarget]:
    return list(
        s.exec(
            select(FirmwareRolloutTarget)
            .where(FirmwareRolloutTarget.rollout_id == rollout_id)
            .order_by(col(FirmwareRolloutTarget.seq))
        ).all()
    )


def rollout_event(
    s: Session,
    r: FirmwareRollout,
    reason: str,
    *,
    actor: str,
    instance: str,
    kind: str = "firmware.rollout",
    machine_id: str | None = None,
    targets: list[FirmwareRolloutTarget] | None = None,
    counts: dict[str, Any] | None = None,
    **data: Any,
) -> None:
    body: dict[str, Any] = {"rollout_id": r.id, "state": r.state, **data}
    if targets is not None:
        body["progress"] = progress(targets)
    elif counts is not None:
        body["progress"] = counts
    add_event(s, kind, actor, machine_id=machine_id, instance=instance, reason=reason, data=body)


class RolloutConflict(Conflict):
    title = "Firmware rollout not possible now"


class FirmwareRollouts:
    name = "firmware_rollouts"

    def __init__(
        self,
        store: Store,
        updates: Updater,
        instance: str,
        *,
        ownership: KeyOwnership | None = None,
        tick_s: float = 2.0,
        lease_s: float = 30.0,
        tasks: TaskScope | None = None,
        notify: Any = lambda: None,
        drain: Drainer | None = None,
    ) -> None:
        self.store = store
        #: The Day-2 path (None: this daemon runs none; ``in_use = drain`` then waits).
        self.drain = drain
        self.updates = updates
        self.instance = instance
        self.actor = f"metald:{instance}"
        self.ownership = ownership
        self.tick_s = tick_s
        self.lease_s = lease_s
        self.tasks = tasks if tasks is not None else TaskScope(self.name)
        self.notify = notify
        self._kick = asyncio.Event()
        self._lock = asyncio.Lock()
        #: Rollouts this instance drove at its last step.
        self.driving: set[str] = set()

    # --- lifecycle ---

    async def start(self) -> None:
        await self.tasks.open()
        self.tasks.spawn(self._loop(), name="firmware-rollouts")

    async def stop(self) -> None:
        await self.tasks.close()

    def wake(self) -> None:
        """Something changed (an update ended, the fleet's live set, an admin's action)."""
        self._kick.set()

    def health(self) -> str:
        return f"running (driving {len(self.driving)} rollouts)"

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("firmware rollouts: a step failed; trying again")
            self._kick.clear()
            await wait_event(self._kick, self.tick_s)

    # --- driving ---

    async def tick(self) -> list[str]:
        """One step of every unfinished rollout this instance holds (or may take over); one
        tick at a time in this instance (the lease keeps the other instances out)."""
        async with self._lock:
            return await self._tick()

    async def _tick(self) -> list[str]:
        ids = await self.store.run(_unfinished)
        driven = []
        if ids:
            # Updates queued by a rollout driven elsewhere start on their BMC's owner here.
            await self.updates.resume()
        for rid in ids:
            if self.ownership is not None and not self.ownership.owns_key(
                f"firmware-rollout:{rid}"
            ):
                continue
            took = await self.store.run(_take_lease, rid, self.instance, self.lease_s)
            if not took:
                continue
            await self.step(rid)
            driven.append(rid)
        self.driving = set(driven)
        return driven

    async def step(self, rid: str) -> None:
        # 1. targets updating: settled by their updates' ends; none queued yet: queue them.
        requeue = await self.store.run(_settle, rid, self.actor, self.instance)
        for mid, version in requeue:
            await self._queue(rid, mid, version)
        # 2. what next, decided by the table from the record.
        decided = await self.store.run(_decide, rid)
        if decided is None:
            return
        decision, decided_in = decided
        starts = await self.store.run(
            _apply, rid, decision, decided_in, self.actor, self.instance, self.drain
        )
        # 3. machines taken into maintenance: their updates queued.
        for mid, version in starts:
            await self._queue(rid, mid, version)
        if starts or decision.state is not RolloutState.RUNNING:
            self.notify()

    async def _queue(self, rid: str, machine_id: str, version: int) -> None:
        try:
            await self.updates.start_update(
                machine_id, components=None, actor=self.actor, baseline_version=version
            )
        except MetaldError as e:
            nothing = "nothing to update" in e.detail
            await self.store.run(
                _target_ended,
                rid,
                machine_id,
                TargetStatus.DONE if nothing else TargetStatus.FAILED,
                None if nothing else e.detail,
                self.actor,
                self.instance,
            )


# --- the store's side (each one transaction) ---


def _unfinished(s: Session) -> list[str]:
    return list(
        s.exec(
            select(FirmwareRollout.id)
            .where(col(FirmwareRollout.finished_at).is_(None))
            .order_by(col(FirmwareRollout.created_at))
        ).all()
    )


def _take_lease(s: Session, rid: str, instance: str, lease_s: float) -> bool:
    """Hold the rollout for ``lease_s`` more (compare-and-swap: only its holder, or anyone
    once the holder's lease ran out)."""
    now = utcnow()
    before = s.exec(select(FirmwareRollout.owner).where(FirmwareRollout.id == rid)).first()
    res = s.exec(  # type: ignore[call-overload]
        update(FirmwareRollout)
        .where(
            col(FirmwareRollout.id) == rid,
            col(FirmwareRollout.finished_at).is_(None),
            or_(
                col(FirmwareRollout.owner).is_(None),
                col(FirmwareRollout.owner) == instance,
                col(FirmwareRollout.lease_until) < now,
            ),
        )
        .values(owner=instance, lease_until=now + timedelta(seconds=lease_s))
    )
    if res.rowcount != 1:
        s.rollback()
        return False
    if before not in (None, instance):
        r = s.get(FirmwareRollout, rid)
        assert r is not None
        rollout_event(
            s,
            r,
            f"instance {instance} took the rollout over from {before} (its lease ran out)",
            actor=f"metald:{instance}",
            instance=instance,
            owner=instance,
            previous_owner=before,
        )
    s.commit()
    return True


def _settle(s: Session, rid: str, actor: str, instance: str) -> list[tuple[str, int]]:
    """End the targets whose updates all ended; the targets updating with no update queued
    (cut off between the two), to queue again."""
    r = s.get(FirmwareRollout, rid)
    if r is None:
        return []
    requeue = []
    for t in s.exec(
        select(FirmwareRolloutTarget).where(
            FirmwareRolloutTarget.rollout_id == rid,
            FirmwareRolloutTarget.status == TargetStatus.UPDATING.value,
        )
    ).all():
        ups = _updates_since(s, t)
        if not ups:
            requeue.append((t.machine_id, r.baseline_version))
            continue
        if any(Phase(u.phase) not in UPDATE_FINAL for u in ups):
            continue
        failed = [u for u in ups if u.phase == Phase.FAILED.value]
        err = "; ".join(f"{u.item}: {u.error}" for u in failed)[:1000] if failed else None
        _end_target(s, r, t, TargetStatus.FAILED if failed else TargetStatus.DONE, err,
                    actor, instance)  # fmt: skip
    s.commit()
    return requeue


def _updates_since(s: Session, t: FirmwareRolloutTarget) -> list[FirmwareUpdate]:
    """The machine's updates queued since the rollout started it."""
    return list(
        s.exec(
            select(FirmwareUpdate).where(
                FirmwareUpdate.machine_id == t.machine_id,
                col(FirmwareUpdate.created_at) >= t.started_at,
            )
        ).all()
    )


def _target_ended(
    s: Session,
    rid: str,
    machine_id: str,
    status: TargetStatus,
    error: str | None,
    actor: str,
    instance: str,
) -> None:
    r = s.get(FirmwareRollout, rid)
    t = s.get(FirmwareRolloutTarget, (rid, machine_id))
    if r is None or t is None or t.status != TargetStatus.UPDATING.value:
        return
    if status is TargetStatus.FAILED and _updates_since(s, t):
        return  # queued already (a second try refused as busy): its updates settle it
    _end_target(s, r, t, status, error, actor, instance)
    s.commit()


def _end_target(
    s: Session,
    r: FirmwareRollout,
    t: FirmwareRolloutTarget,
    status: TargetStatus,
    error: str | None,
    actor: str,
    instance: str,
) -> None:
    t.status, t.error, t.finished_at = status.value, error, utcnow()
    s.add(t)
    m = s.get(Machine, t.machine_id)
    back = ""
    if (
        status is TargetStatus.DONE
        and m is not None
        and t.prior_state == State.READY.value
        and m.state == State.MAINTENANCE.value
    ):
        transition(
            s,
            m.id,
            Trigger.MAINTENANCE_OFF,
            actor=actor,
            reason=f"firmware rollout {r.id}: updated, back in the pool",
            instance=instance,
            commit=False,
            machine=m,
        )
        back = "; back to ready"
    elif status is TargetStatus.FAILED:
        back = "; left in maintenance for a person to look at"
    s.flush()
    rollout_event(
        s,
        r,
        f"firmware rollout {r.id}: machine {t.machine_id} {status.value}"
        + (f": {error}" if error else "")
        + back,
        actor=actor,
        instance=instance,
        kind="firmware.rollout-machine",
        machine_id=t.machine_id,
        counts=_counts(s, r.id),
        status=status.value,
        error=error,
    )


def _decide(s: Session, rid: str) -> tuple[Plan, RolloutState] | None:
    """The plan, and the state it was decided in."""
    r = s.get(FirmwareRollout, rid)
    if r is None:
        return None
    rows = targets_of(s, rid)
    found = s.exec(
        select(Machine.id, Machine.state, Claim.firmware_consent)
        .outerjoin(Claim, col(Claim.id) == Machine.claim_id)
        .where(col(Machine.id).in_([t.machine_id for t in rows]))
    ).all()
    states = {mid: st for mid, st, _ in found}
    consent = {mid for mid, st, ok in found if ok and st in ALLOCATED_STATES}
    policy = Policy(r.batch_size, r.max_unavailable, r.failure_budget, InUse(r.in_use))
    targets = [
        Target(
            t.machine_id,
            TargetStatus(t.status),
            t.wave,
            availability(states.get(t.machine_id)),
            consent=t.machine_id in consent,
        )  # fmt: skip
        for t in rows
    ]
    return plan(RolloutState(r.state), policy, targets), RolloutState(r.state)


def _apply(
    s: Session,
    rid: str,
    p: Plan,
    decided_in: RolloutState,
    actor: str,
    instance: str,
    drain: Drainer | None = None,
) -> list[tuple[str, int]]:
    """Record the plan; the machines taken into maintenance (their updates to queue). The
    rollout's row is locked, and a plan decided in another state than the one found now (an
    admin paused or aborted it meanwhile) is dropped: the next step decides again."""
    r = s.exec(select(FirmwareRollout).where(FirmwareRollout.id == rid).with_for_update()).first()
    if r is None or r.state != decided_in.value:
        s.rollback()
        return []
    rows = {t.machine_id: t for t in targets_of(s, rid)}
    now = utcnow()
    for mid, why in p.skip:
        t = rows[mid]
        t.status, t.error, t.finished_at = TargetStatus.SKIPPED.value, why, now
        s.add(t)
        rollout_event(s, r, f"firmware rollout {r.id}: machine {mid} skipped: {why}",
                      actor=actor, instance=instance, kind="firmware.rollout-machine",
                      machine_id=mid, status="skipped", error=why)  # fmt: skip
    waiting = list(p.wait)
    for mid in p.drain:
        t = rows[mid]
        why = (f"firmware rollout {r.id}: profile {r.profile}'s baseline version "
               f"{r.baseline_version}")  # fmt: skip
        opened = drain.open(s, mid, reason=why, actor=actor, instance=instance) if drain else None
        if opened is None:
            # No Day-2 path in this daemon, consent withdrawn meanwhile, or the machine has a
            # remediation open already (it leaves its claim anyway): wait for its release.
            waiting.append(mid)
            continue
        t.status, t.wave = TargetStatus.DRAINING.value, None
        s.add(t)
        rollout_event(s, r, f"firmware rollout {r.id}: machine {mid} is in use; its tenant "
                      "consented: drained through the Day-2 path (out of its claim, replaced "
                      "by its policy), then updated from the pool", actor=actor,
                      instance=instance, kind="firmware.rollout-machine", machine_id=mid,
                      status="draining", remediation_id=opened)  # fmt: skip
    for mid in waiting:
        t = rows[mid]
        if t.status != TargetStatus.WAITING.value or t.wave is not None:
            t.status, t.wave = TargetStatus.WAITING.value, None
            s.add(t)
            rollout_event(s, r, f"firmware rollout {r.id}: machine {mid} is in use; it is "
                          "updated once its tenant releases it", actor=actor, instance=instance,
                          kind="firmware.rollout-machine", machine_id=mid,
                          status="waiting")  # fmt: skip
    if p.join:
        for mid in p.join:
            rows[mid].wave, rows[mid].status = p.wave, TargetStatus.PENDING.value
            s.add(rows[mid])
        rollout_event(s, r, f"firmware rollout {r.id}: wave {p.wave} of {len(p.join)} "
                      "machines", actor=actor, instance=instance, wave=p.wave,
                      machines=p.join[:100])  # fmt: skip
    started: list[tuple[str, int]] = []
    for mid in p.start:
        t = rows[mid]
        m = s.get(Machine, mid)
        if t.status not in (TargetStatus.PENDING.value, TargetStatus.WAITING.value):
            continue  # started already (the record is the guard)
        if m is None or m.state not in FREE_STATES:
            continue  # taken meanwhile: the next step sees it busy or gone
        t.prior_state = m.state
        if m.state == State.READY.value:
            transition(s, mid, Trigger.MAINTENANCE_ON, actor=actor, instance=instance,
                       reason=f"firmware rollout {r.id}: out of the pool while its firmware "
                       f"is updated to profile {r.profile}'s baseline version "
                       f"{r.baseline_version}", commit=False, machine=m)  # fmt: skip
        t.status, t.started_at = TargetStatus.UPDATING.value, now
        s.add(t)
        started.append((mid, r.baseline_version))
    if p.state is not RolloutState(r.state):
        r.state, r.reason = p.state.value, p.reason
        kind = {
            RolloutState.STOPPED: "firmware.rollout-stopped",
            RolloutState.DONE: "firmware.rollout-done",
        }.get(p.state, "firmware.rollout")
        s.flush()
        rollout_event(s, r, f"firmware rollout {r.id} {p.state.value}: {p.reason}",
                      actor=actor, instance=instance, kind=kind,
                      targets=list(rows.values()))  # fmt: skip
    if RolloutState(r.state) in ENDED and not any(
        t.status == TargetStatus.UPDATING.value for t in rows.values()
    ):
        r.finished_at, r.owner, r.lease_until = now, None, None
    r.updated_at = now
    s.add(r)
    s.commit()
    return started
