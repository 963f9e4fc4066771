"""A firmware rollout's decisions, as a table: which machines start next, when the failure
budget stops it, when it is over.

Pure: no store, no BMC, no clock. ``metald.firmware.rollouts`` reads the rollout and its
targets from the store, asks ``plan`` what to do, and records each decision before it acts on
it, so whichever instance drives the rollout next (after a crash) asks again from the same
record and gets the same answer.

The rules:

- targets go in **waves** of ``batch_size`` machines, in the rollout's order; a wave starts
  only when the one before it has ended (every machine done, failed or skipped);
- within a wave at most ``max_unavailable`` machines update at once;
- a machine in use (a tenant's) is ``skipped`` or, with ``in_use = wait``, ``waiting`` for its
  release: it joins a later wave once it is free; with ``in_use = drain``, a machine whose
  claim's tenant consented is ``draining`` (the Day-2 path takes it out of the claim: drained
  in the tenant's scheduler, replaced, released and wiped) and joins a later wave once free;
  one without consent waits for its release (and is drained once consent comes);
- a machine gone (retired, broken, in repair, deleted) is skipped, with why;
- the **failure budget**: once ``failure_budget`` machines have failed, nothing more starts and
  the rollout stops with the failed machines named (the updates already flashing finish: a
  flash is never cut off);
- paused: nothing starts; aborted or stopped: nothing starts ever again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class RolloutState(StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    #: Every target ended (done, failed under the budget, or skipped).
    DONE = "done"
    #: The failure budget tripped.
    STOPPED = "stopped"
    ABORTED = "aborted"


#: States in which nothing starts any more.
ENDED = frozenset({RolloutState.DONE, RolloutState.STOPPED, RolloutState.ABORTED})


class TargetStatus(StrEnum):
    #: Not started (and not yet found in use).
    PENDING = "pending"
    #: In use by a tenant; starts once released (``in_use = wait``).
    WAITING = "waiting"
    #: Being taken out of its claim with its tenant's consent (``in_use = drain``); starts
    #: once back in the pool.
    DRAINING = "draining"
    #: In maintenance, its firmware updates under way.
    UPDATING = "updating"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"


FINAL = frozenset({TargetStatus.DONE, TargetStatus.FAILED, TargetStatus.SKIPPED})
#: Not started, out of any wave until free.
OUT_OF_WAVE = frozenset({TargetStatus.PENDING, TargetStatus.WAITING, TargetStatus.DRAINING})


class InUse(StrEnum):
    """What a rollout does with a machine a tenant holds."""

    SKIP = "skip"
    WAIT = "wait"
    #: With the tenant's consent (its claim's ``firmware_consent``), drained through the
    #: Day-2 path; without it, wait.
    DRAIN = "drain"


class Availability(StrEnum):
    #: Ready or in maintenance: may be taken into maintenance and flashed now.
    FREE = "free"
    #: A tenant's, or in an operation (inspecting, wiping ...): not now.
    BUSY = "busy"
    #: Retired, broken, in repair or deleted: never in this rollout.
    GONE = "gone"


@dataclass(frozen=True)
class Policy:
    batch_size: int
    max_unavailable: int
    failure_budget: int
    in_use: InUse = InUse.SKIP

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_unavailable < 1 or self.failure_budget < 1:
            raise ValueError("batch_size, max_unavailable and failure_budget are at least 1")


@dataclass(frozen=True)
class Target:
    machine_id: str
    status: TargetStatus
    #: The wave it was put in (None: not yet).
    wave: int | None = None
    available: Availability = Availability.FREE
    #: In use by a claim whose tenant consented to a drain.
    consent: bool = False


@dataclass(frozen=True)
class Plan:
    state: RolloutState
    #: Machines to take into maintenance and start updating now, in order.
    start: list[str] = field(default_factory=list)
    #: Machines put in a new wave (``wave``), before any of them starts.
    wave: int | None = None
    join: list[str] = field(default_factory=list)
    #: (machine, why) skipped now; machines found in use that now wait for their release
    #: (out of any wave: they join a later one once free).
    skip: list[tuple[str, str]] = field(default_factory=list)
    wait: list[str] = field(default_factory=list)
    #: Machines in use whose tenant consented: to take out of their claim (Day-2 path), out
    #: of any wave: they join a later one once free.
    drain: list[str] = field(default_factory=list)
    #: Why the state changed (only when it did).
    reason: str | None = None


def plan(state: RolloutState, policy: Policy, targets: Sequence[Target]) -> Plan:
    """What the rollout does next, from its state and its targets as recorded (in order)."""
    failed = [t.machine_id for t in targets if t.status is TargetStatus.FAILED]
    if state in ENDED:
        return Plan(state)
    if len(failed) >= policy.failure_budget:
        return Plan(
            RolloutState.STOPPED,
            reason=f"the failure budget of {policy.failure_budget} is spent: "
            f"{len(failed)} machine(s) failed ({', '.join(failed[:10])}); nothing more starts",
        )
    if state is RolloutState.PAUSED:
        return Plan(state)
    skip: list[tuple[str, str]] = []
    wait: list[str] = []
    drain: list[str] = []

    def busy(t: Target, into: list[tuple[str, str]]) -> None:
        """A machine in use, by the policy."""
        if policy.in_use is InUse.SKIP:
            into.append((t.machine_id, "the machine is in use (policy: skip)"))
        elif policy.in_use is InUse.DRAIN and t.consent:
            drain.append(t.machine_id)
        elif t.status is not TargetStatus.WAITING or t.wave is not None:
            wait.append(t.machine_id)

    for t in targets:
        if t.status not in OUT_OF_WAVE or t.wave is not None:
            continue
        if t.available is Availability.GONE:
            skip.append((t.machine_id, "the machine is retired, broken, in repair or gone"))
        elif t.available is Availability.BUSY and (
            t.status is TargetStatus.PENDING
            or (t.status is TargetStatus.WAITING and policy.in_use is InUse.DRAIN and t.consent)
        ):
            busy(t, skip)
    skipped = {m for m, _ in skip}
    waves = [t.wave for t in targets if t.wave is not None]
    current = max(waves) if waves else None
    in_wave = [t for t in targets if current is not None and t.wave == current]
    open_wave = [t for t in in_wave if t.status not in FINAL and t.machine_id not in skipped]
    join: list[str] = []
    new_wave = None
    if not open_wave:
        # The wave before ended (or none began): the next free machines, in order.
        free = [
            t
            for t in targets
            if t.wave is None
            and t.status in OUT_OF_WAVE
            and t.available is Availability.FREE
            and t.machine_id not in skipped
        ]
        if free:
            new_wave = (current or 0) + 1
            join = [t.machine_id for t in free[: policy.batch_size]]
            open_wave = [Target(m, TargetStatus.PENDING, new_wave, Availability.FREE) for m in join]
    updating = sum(1 for t in targets if t.status is TargetStatus.UPDATING)
    slots = max(0, policy.max_unavailable - updating)
    start: list[str] = []
    skip_in_wave: list[tuple[str, str]] = []
    for t in open_wave:
        if t.status not in (TargetStatus.PENDING, TargetStatus.WAITING):
            continue
        if t.available is Availability.GONE:
            skip_in_wave.append((t.machine_id, "the machine is retired, broken, in repair or gone"))
        elif t.available is Availability.BUSY:
            # Taken by a tenant since it joined the wave: by the policy, as if found so now
            # (waiting or draining leaves the wave, so that it does not hold the next one up).
            busy(t, skip_in_wave)
        elif len(start) < slots:
            start.append(t.machine_id)
    skip += skip_in_wave
    # Over: nothing left to start, nothing under way, nobody waiting.
    gone = {m for m, _ in skip}
    left = [t for t in targets if t.machine_id not in gone and t.status not in FINAL]
    if not left and not join:
        n_done = sum(1 for t in targets if t.status is TargetStatus.DONE)
        return Plan(
            RolloutState.DONE,
            skip=skip,
            reason=f"every machine ended: {n_done} updated, {len(failed)} failed, "
            f"{sum(1 for t in targets if t.status is TargetStatus.SKIPPED) + len(skip)} skipped",
        )
    return Plan(state, start=start, wave=new_wave, join=join, skip=skip, wait=wait, drain=drain)
