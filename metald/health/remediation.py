"""Remediation: from a machine's classified faults to the next step, one table.

A remediation is a record the workflow journals: the machine, its claim and rack, the worst
severity and its evidence, the claim's policy (kept from when it started) and the ``step``
it is at. ``decide`` reads the record and the facts of now and returns the ``Decision``: the
action to perform (idempotent: draining twice, removing twice and repairing twice change
nothing; a replacement is claimed under the remediation's id as its key) and the step to store
once it is done. A crash anywhere resumes from the stored step and reaches the same end;
``decide`` never asks for a replacement once one is recorded.

Rate limits: a remediation leaves ``waiting`` only when its claim and its rack have fewer
than ``limits.per_claim`` / ``limits.per_rack`` machines in remediation (every step but
``waiting`` and ``done`` holds a slot: a drained machine is out of the tenant's use); the
refusal names why. Admissions must be decided one at a time (the workflow takes them in one
store transaction), as ``decide`` sees the others through ``active``.

A remediation's **cause** is a fault (``health``) or a firmware rollout (``firmware``): a
machine in use whose tenant consented to be drained for its firmware update (docs/firmware.md).
It goes the same way (admission under the same limits, drain, running jobs may finish, out
of the claim, a replacement when the claim's policy replaces) whatever the machine's health,
and ends once it is out of the claim: no repair (it is released and wiped, and the rollout
flashes it from the pool).

Pure: no store, no scheduler, no clock of its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum

from metald.health.classify import Severity, worst
from metald.health.config import LimitsConfig, PolicyConfig


class Step(StrEnum):
    WAITING = "waiting"  # found; not admitted yet (rate limits)
    DRAIN = "drain"  # drain the node in the tenant's scheduler
    WAIT_JOBS = "wait-jobs"  # drained, fatal: running jobs may finish, up to job_wait_s
    DRAINED = "drained"  # drained, degraded (or a fatal the policy only drains): watched
    REMOVE = "remove"  # out of the scheduler and of the claim
    REPLACE = "replace"  # claim a healthy machine of the same selector for the claim
    REPAIR = "repair"  # the bad machine to the repair queue, with its evidence
    UNDRAIN = "undrain"  # a degraded fault cleared by a trusted witness: back in service
    DONE = "done"


class Cause(StrEnum):
    HEALTH = "health"
    FIRMWARE = "firmware"


class Action(StrEnum):
    NONE = "none"
    DRAIN = "drain"
    REMOVE = "remove"
    REPLACE = "replace"
    REPAIR = "repair"
    UNDRAIN = "undrain"


class Outcome(StrEnum):
    ADMITTED = "admitted"
    REFUSED = "refused"
    NOTHING = "nothing"  # nothing to do (healthy again, or the policy does nothing)
    DONE = "done"  # the step's action was performed
    TAKE_OUT = "take-out"  # fatal, and the policy takes the machine out of the claim
    KEEP = "keep"  # drained, and the policy keeps the machine in the claim
    JOBS_GONE = "jobs-gone"
    DEADLINE = "deadline"
    WAIT = "wait"
    CLEARED = "cleared"
    NO_REPLACEMENT = "no-replacement"
    #: Out of the claim for its firmware update (cause ``firmware``): nothing to repair.
    RELEASED = "released"


#: The action each step performs (steps without one only look at the facts).
ACTIONS: dict[Step, Action] = {
    Step.DRAIN: Action.DRAIN,
    Step.REMOVE: Action.REMOVE,
    Step.REPLACE: Action.REPLACE,
    Step.REPAIR: Action.REPAIR,
    Step.UNDRAIN: Action.UNDRAIN,
}

#: (step, outcome) -> the step stored next.
TRANSITIONS: dict[tuple[Step, Outcome], Step] = {
    (Step.WAITING, Outcome.ADMITTED): Step.DRAIN,
    (Step.WAITING, Outcome.REFUSED): Step.WAITING,
    (Step.WAITING, Outcome.NOTHING): Step.DONE,
    (Step.DRAIN, Outcome.TAKE_OUT): Step.WAIT_JOBS,
    (Step.DRAIN, Outcome.KEEP): Step.DRAINED,
    (Step.WAIT_JOBS, Outcome.JOBS_GONE): Step.REMOVE,
    (Step.WAIT_JOBS, Outcome.DEADLINE): Step.REMOVE,
    (Step.WAIT_JOBS, Outcome.WAIT): Step.WAIT_JOBS,
    (Step.DRAINED, Outcome.TAKE_OUT): Step.WAIT_JOBS,
    (Step.DRAINED, Outcome.CLEARED): Step.UNDRAIN,
    (Step.DRAINED, Outcome.WAIT): Step.DRAINED,
    (Step.REMOVE, Outcome.DONE): Step.REPLACE,
    (Step.REMOVE, Outcome.NO_REPLACEMENT): Step.REPAIR,
    (Step.REPLACE, Outcome.DONE): Step.REPAIR,
    (Step.REMOVE, Outcome.RELEASED): Step.DONE,
    (Step.REPLACE, Outcome.RELEASED): Step.DONE,
    (Step.REPAIR, Outcome.DONE): Step.DONE,
    (Step.UNDRAIN, Outcome.DONE): Step.DONE,
}

#: Steps that hold one of the claim's and the rack's remediation slots.
HOLDS_SLOT = frozenset(Step) - {Step.WAITING, Step.DONE}


@dataclass(frozen=True)
class Remediation:
    id: str
    machine: str
    #: The machine's node name in the tenant's scheduler.
    node: str
    claim: str
    rack: str | None
    severity: Severity
    evidence: str
    policy: PolicyConfig
    step: Step = Step.WAITING
    drained_at: datetime | None = None
    #: The machine claimed in its place (recorded with the step after ``replace``).
    replacement: str | None = None
    cause: Cause = Cause.HEALTH


@dataclass(frozen=True)
class Facts:
    now: datetime
    #: The machine's health now (``metald.health.trust.Health.severity``).
    severity: Severity
    #: Its evidence (the worst faults'), kept when the severity gets worse.
    evidence: str = ""
    #: Jobs running on the node, as the scheduler says; None when it could not be asked.
    running_jobs: int | None = None


@dataclass(frozen=True)
class Decision:
    action: Action
    outcome: Outcome
    next: Step
    #: The sentence of the event the tenant's orchestrator sees on its claim.
    reason: str


def refusal(rem: Remediation, active: Iterable[Remediation], limits: LimitsConfig) -> str | None:
    """Why ``rem`` may not start now, or None."""
    holding = [a for a in active if a.step in HOLDS_SLOT and a.id != rem.id]
    same_claim = sorted(a.machine for a in holding if a.claim == rem.claim)
    if len(same_claim) >= limits.per_claim:
        return (
            f"{rem.machine} waits: claim {rem.claim} already has {len(same_claim)} machine(s) "
            f"in remediation ({', '.join(same_claim[:5])}), the limit is {limits.per_claim}"
        )
    if rem.rack is not None:
        same_rack = sorted(a.machine for a in holding if a.rack == rem.rack)
        if len(same_rack) >= limits.per_rack:
            return (
                f"{rem.machine} waits: rack {rem.rack} already has {len(same_rack)} "
                f"machine(s) in remediation ({', '.join(same_rack[:5])}), the limit is "
                f"{limits.per_rack}"
            )
    return None


def _takes_out(rem: Remediation) -> bool:
    return rem.cause is Cause.FIRMWARE or rem.policy.fatal in ("replace", "remove")


def severity_of(rem: Remediation, now: Severity) -> Severity:
    """The severity the table acts on: a firmware drain is taken out whatever the health."""
    if rem.cause is Cause.FIRMWARE:
        return Severity.FATAL
    return worst((rem.severity, now)) if rem.step != Step.WAITING else now


def _outcome(
    rem: Remediation, f: Facts, active: Iterable[Remediation], limits: LimitsConfig
) -> tuple[Outcome, str]:
    sev = severity_of(rem, f.severity)
    fatal = sev == Severity.FATAL
    firmware = rem.cause is Cause.FIRMWARE
    m = rem.machine
    match rem.step:
        case Step.WAITING:
            if sev.rank < Severity.DEGRADED.rank:
                return Outcome.NOTHING, f"{m} is {sev} now: nothing to do"
            if not fatal and rem.policy.degraded == "none":
                return Outcome.NOTHING, f"{m} is degraded and the claim's policy does nothing"
            why = refusal(rem, active, limits)
            if why is not None:
                return Outcome.REFUSED, why
            if firmware:
                return (
                    Outcome.ADMITTED,
                    f"draining node {rem.node} with the tenant's consent: {rem.evidence}",
                )
            return (
                Outcome.ADMITTED,
                f"{m} is {sev}: draining node {rem.node} ({f.evidence or rem.evidence})",
            )
        case Step.DRAIN:
            if fatal and _takes_out(rem):
                wait = rem.policy.job_wait_s
                return Outcome.TAKE_OUT, f"{m} drained; running jobs may finish for up to {wait} s"
            return Outcome.KEEP, f"{m} drained; it stays in the claim"
        case Step.DRAINED:
            if fatal and _takes_out(rem):
                return Outcome.TAKE_OUT, f"{m} is fatal now ({f.evidence}): it will be taken out"
            if f.severity.rank < Severity.DEGRADED.rank and not fatal:
                return Outcome.CLEARED, f"{m}'s fault cleared: undraining node {rem.node}"
            return Outcome.WAIT, f"{m} stays drained"
        case Step.WAIT_JOBS:
            if f.running_jobs == 0:
                return Outcome.JOBS_GONE, f"no job runs on node {rem.node}: taking {m} out"
            drained = rem.drained_at or f.now
            if f.now >= drained + timedelta(seconds=rem.policy.job_wait_s):
                jobs = "an unknown number of" if f.running_jobs is None else str(f.running_jobs)
                return Outcome.DEADLINE, (
                    f"{jobs} job(s) still run on node {rem.node} after "
                    f"{rem.policy.job_wait_s} s: taking {m} out now"
                )
            jobs = "its jobs" if f.running_jobs is None else f"{f.running_jobs} job(s)"
            return Outcome.WAIT, f"waiting for {jobs} on node {rem.node}"
        case Step.REMOVE:
            # A firmware drain of a machine found fatal meanwhile ends like a fault: repaired.
            if firmware and f.severity is not Severity.FATAL and rem.policy.fatal != "replace":
                return Outcome.RELEASED, (
                    f"{m} is out of claim {rem.claim} for its firmware update (the policy "
                    "replaces none); it is wiped and updated from the pool"
                )
            if rem.policy.fatal == "replace":
                return Outcome.DONE, f"{m} is out of claim {rem.claim}: claiming a replacement"
            return (
                Outcome.NO_REPLACEMENT,
                f"{m} is out of claim {rem.claim} (the policy replaces none)",
            )
        case Step.REPLACE:
            if firmware and f.severity is not Severity.FATAL:
                return Outcome.RELEASED, (
                    f"a replacement for {m} joins claim {rem.claim}; {m} is wiped and updated "
                    "from the pool"
                )
            return Outcome.DONE, f"a replacement for {m} joins claim {rem.claim}"
        case Step.REPAIR:
            return Outcome.DONE, f"{m} is in the repair queue: {rem.evidence}"
        case Step.UNDRAIN:
            return Outcome.DONE, f"node {rem.node} is back in service"
    raise ValueError(f"remediation {rem.id} is done: nothing to decide")


def decide(
    rem: Remediation,
    facts: Facts,
    *,
    active: Iterable[Remediation] = (),
    limits: LimitsConfig = LimitsConfig(),
) -> Decision:
    """The next action and the step to store after it. ``active`` are the other
    remediations (only needed in ``waiting``)."""
    outcome, reason = _outcome(rem, facts, active, limits)
    nxt = TRANSITIONS[(rem.step, outcome)]
    action = ACTIONS.get(rem.step, Action.NONE) if nxt != rem.step else Action.NONE
    if rem.step == Step.REPLACE and rem.replacement is not None:
        action = Action.NONE  # recorded already: never a second replacement
    return Decision(action, outcome, nxt, reason)


def advance(
    rem: Remediation, d: Decision, facts: Facts, *, replacement: str | None = None
) -> Remediation:
    """The record to store once ``d``'s action is done. A replacement is recorded once:
    a second, different one is refused."""
    if d.action == Action.REPLACE:
        if replacement is None:
            raise ValueError("a replace step is done only with the replacement's machine id")
        if rem.replacement not in (None, replacement):
            raise ValueError(f"{rem.machine} already has replacement {rem.replacement}")
    if rem.cause is Cause.FIRMWARE:  # its severity and evidence are the rollout's
        sev, evidence = rem.severity, rem.evidence
    else:
        sev = severity_of(rem, facts.severity)
        evidence = (
            facts.evidence if sev.rank > rem.severity.rank and facts.evidence else rem.evidence
        )
    return replace(
        rem,
        step=d.next,
        severity=sev,
        evidence=evidence,
        drained_at=facts.now if d.action == Action.DRAIN else rem.drained_at,
        replacement=replacement if d.action == Action.REPLACE else rem.replacement,
    )


def drain_reason(rem: Remediation, limit: int = 200) -> str:
    """The reason written into the scheduler (``sinfo -R`` shows it): ``metald: <evidence>``
    on one line, bounded."""
    text = " ".join(f"metald: {rem.evidence}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
