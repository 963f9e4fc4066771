"""The remediation table: policies, rate limits, and resuming after a crash at any step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metald.health.classify import Severity
from metald.health.config import LimitsConfig, PolicyConfig
from metald.health.remediation import (
    ACTIONS,
    HOLDS_SLOT,
    TRANSITIONS,
    Action,
    Cause,
    Facts,
    Remediation,
    Step,
    advance,
    decide,
    drain_reason,
)

T0 = datetime(2026, 12, 6, 4, 0, tzinfo=UTC)
F, D, OK = Severity.FATAL, Severity.DEGRADED, Severity.OK


def rem(
    machine: str = "m1",
    *,
    claim: str = "c1",
    rack: str | None = "r1",
    sev: Severity = F,
    policy: PolicyConfig | None = None,
) -> Remediation:
    return Remediation(f"rem-{machine}", machine, f"node-{machine}", claim, rack, sev,
                       f"XID 79 on GPU 0000:3b:00 of {machine}", policy or PolicyConfig())  # fmt: skip


@dataclass
class World:
    """The scheduler, the claim and the repair queue, each action idempotent like the real
    ones; a replacement is claimed under the remediation's id as its key."""

    drained: set[str] = field(default_factory=set)
    removed: set[str] = field(default_factory=set)
    repaired: dict[str, str] = field(default_factory=dict)
    replacements: dict[str, str] = field(default_factory=dict)
    replace_keys: list[str] = field(default_factory=list)
    jobs: int = 0

    def perform(self, r: Remediation, action: Action) -> str | None:
        match action:
            case Action.DRAIN:
                self.drained.add(r.node)
            case Action.UNDRAIN:
                self.drained.discard(r.node)
            case Action.REMOVE:
                self.removed.add(r.node)
                self.jobs = 0
            case Action.REPLACE:
                self.replace_keys.append(r.id)
                return self.replacements.setdefault(r.id, f"spare-{len(self.replacements)}")
            case Action.REPAIR:
                self.repaired[r.machine] = r.evidence
        return None

    def end(self) -> tuple[object, ...]:
        return (self.drained, self.removed, self.repaired, self.replacements)


def run(
    r: Remediation,
    severities: list[Severity],
    *,
    jobs: int,
    crashes: frozenset[int] = frozenset(),
    crash_after: bool = True,
) -> tuple[Remediation, World]:
    """Drive ``r`` to its end; at each tick in ``crashes`` the instance dies before storing
    the step (after performing the action when ``crash_after``) and a survivor resumes from
    the stored record."""
    world, stored, now = World(jobs=jobs), r, T0
    for tick in range(500):
        if stored.step == Step.DONE:
            return stored, world
        sev = severities[min(tick, len(severities) - 1)]
        facts = Facts(now, sev, f"evidence of {sev}", running_jobs=world.jobs)
        d = decide(stored, facts)
        assert not (d.action == Action.REPLACE and stored.replacement is not None)
        if stored.step == Step.DRAINED == d.next and tick >= len(severities):
            return stored, world  # a fatal the policy only drains: drained until a repair
        if tick in crashes and d.action != Action.NONE:
            if crash_after:
                world.perform(stored, d.action)
            now += timedelta(seconds=1)
            continue  # died: nothing stored
        got = world.perform(stored, d.action)
        stored = advance(stored, d, facts, replacement=got)
        now += timedelta(seconds=30)
        if world.jobs:
            world.jobs -= 1
    raise AssertionError(f"no end after 500 ticks: {stored}")


policies = st.builds(
    PolicyConfig,
    degraded=st.sampled_from(["drain", "none"]),
    fatal=st.sampled_from(["replace", "remove", "drain"]),
    job_wait_s=st.sampled_from([0, 60, 3600]),
)


@settings(max_examples=300, deadline=None)
@given(
    policy=policies,
    first=st.sampled_from([F, D]),
    later=st.lists(st.sampled_from([F, D]), min_size=1, max_size=8),
    jobs=st.integers(0, 5),
    crashes=st.frozensets(st.integers(0, 40), max_size=10),
    crash_after=st.booleans(),
)
def test_a_crash_at_any_step_resumes_to_the_same_end(
    policy: PolicyConfig,
    first: Severity,
    later: list[Severity],
    jobs: int,
    crashes: frozenset[int],
    crash_after: bool,
) -> None:
    # the machine's health as the trust fold gives it: fatal is sticky (no signal clears it);
    # a degraded fault may turn fatal, or clears at the end. (A fault that clears and comes
    # back is a second remediation: when it comes back depends on timing, not on crashes.)
    sevs = [first, *later]
    if F in sevs:
        sevs = sevs[: sevs.index(F)] + [F] * (len(sevs) - sevs.index(F))
    sevs.append(F if F in sevs else OK)
    start = rem(sev=first, policy=policy)
    clean, w1 = run(start, sevs, jobs=jobs)
    crashed, w2 = run(start, sevs, jobs=jobs, crashes=crashes, crash_after=crash_after)
    kept = F in sevs and policy.fatal == "drain" and w1.drained
    assert clean.step == crashed.step == (Step.DRAINED if kept else Step.DONE)
    assert w1.end() == w2.end()
    assert clean.replacement == crashed.replacement
    assert len(w2.replacements) <= 1 and set(w2.replace_keys) <= {start.id}
    if first == F and policy.fatal == "replace":
        assert crashed.replacement == "spare-0" and w2.repaired == {"m1": start.evidence}
        assert start.node in w2.removed
    if first == F and policy.fatal == "remove":
        assert crashed.replacement is None and start.node in w2.removed


@settings(max_examples=200, deadline=None)
@given(
    machines=st.lists(
        st.tuples(st.sampled_from(["c1", "c2"]), st.sampled_from(["r1", "r2", None]),
                  st.sampled_from([F, D])),
        min_size=1, max_size=12,
    ),
    order=st.lists(st.integers(0, 11), min_size=1, max_size=200),
    per_claim=st.integers(1, 3),
    per_rack=st.integers(1, 3),
)  # fmt: skip
def test_never_more_in_remediation_than_the_limits(
    machines: list[tuple[str, str | None, Severity]],
    order: list[int],
    per_claim: int,
    per_rack: int,
) -> None:
    limits = LimitsConfig(per_claim=per_claim, per_rack=per_rack)
    rems = [rem(f"m{i}", claim=c, rack=k, sev=s) for i, (c, k, s) in enumerate(machines)]
    now = T0
    for tick, pick in enumerate(order):
        i = pick % len(rems)
        r = rems[i]
        if r.step == Step.DONE:
            continue
        # degraded machines heal after a while, so slots free up
        sev = r.severity if r.severity == F or tick < 100 else OK
        facts = Facts(now, sev, "", running_jobs=0)
        d = decide(r, facts, active=rems, limits=limits)
        if d.next == Step.WAITING:
            assert "waits:" in d.reason and ("claim" in d.reason or "rack" in d.reason)
        rems[i] = advance(r, d, facts, replacement="spare" if d.action == Action.REPLACE else None)
        now += timedelta(seconds=10)
        holding = [x for x in rems if x.step in HOLDS_SLOT]
        for c in ("c1", "c2"):
            assert sum(x.claim == c for x in holding) <= per_claim
        for k in ("r1", "r2"):
            assert sum(x.rack == k for x in holding) <= per_rack


def test_the_table_reaches_done_from_every_step() -> None:
    nexts: dict[Step, set[Step]] = {}
    for (s, _), n in TRANSITIONS.items():
        nexts.setdefault(s, set()).add(n)
    for s in set(Step) - {Step.DONE}:
        seen, todo = set(), [s]
        while todo:
            x = todo.pop()
            if x not in seen:
                seen.add(x)
                todo += nexts.get(x, set())
        assert Step.DONE in seen, s
    assert set(ACTIONS) < set(Step)


def step_through(r: Remediation, facts: Facts, **kw) -> tuple[Remediation, list[str]]:  # type: ignore[no-untyped-def]
    seen = []
    while r.step != Step.DONE:
        d = decide(r, facts, **kw)
        seen.append(f"{r.step}:{d.action}")
        if d.next == r.step:
            break
        r = advance(r, d, facts, replacement="spare" if d.action == Action.REPLACE else None)
    return r, seen


def test_fatal_with_job_wait_zero_goes_all_the_way_now() -> None:
    p = PolicyConfig(job_wait_s=0)
    end, seen = step_through(rem(policy=p), Facts(T0, F, running_jobs=3))
    assert seen == ["waiting:none", "drain:drain", "wait-jobs:none", "remove:remove",
                    "replace:replace", "repair:repair"]  # fmt: skip
    assert end.replacement == "spare" and end.drained_at == T0


def test_fatal_waits_for_jobs_up_to_the_bound() -> None:
    r, _ = step_through(rem(policy=PolicyConfig(job_wait_s=600)), Facts(T0, F, running_jobs=2))
    assert r.step == Step.WAIT_JOBS
    assert decide(r, Facts(T0 + timedelta(seconds=599), F, running_jobs=2)).next == r.step
    unknown = decide(r, Facts(T0 + timedelta(seconds=599), F, running_jobs=None))
    assert (
        unknown.next == Step.WAIT_JOBS and unknown.reason == "waiting for its jobs on node node-m1"
    )
    late = decide(r, Facts(T0 + timedelta(seconds=600), F, running_jobs=None))
    assert late.next == Step.REMOVE and "an unknown number of job(s)" in late.reason
    assert decide(r, Facts(T0 + timedelta(1), F, running_jobs=0)).outcome == "jobs-gone"


def test_degraded_drains_escalates_and_clears() -> None:
    r, seen = step_through(rem(sev=D), Facts(T0, D))
    assert (r.step, seen) == (Step.DRAINED, ["waiting:none", "drain:drain", "drained:none"])
    cleared, seen = step_through(r, Facts(T0, OK))
    assert seen == ["drained:none", "undrain:undrain"] and cleared.step == Step.DONE
    worse = advance(r, decide(r, Facts(T0, F, "XID 79 now")), Facts(T0, F, "XID 79 now"))
    assert (worse.step, worse.severity, worse.evidence) == (Step.WAIT_JOBS, F, "XID 79 now")


def test_fatal_never_undrains_and_a_drain_only_policy_keeps_it_drained() -> None:
    r, _ = step_through(rem(policy=PolicyConfig(fatal="drain")), Facts(T0, F))
    assert r.step == Step.DRAINED
    assert decide(r, Facts(T0, OK)).next == Step.DRAINED


@pytest.mark.parametrize("fatal", ["replace", "remove", "drain"])
def test_a_firmware_drain_goes_out_of_the_claim_whatever_the_health_and_is_never_repaired(
    fatal: str,
) -> None:
    """Cause ``firmware`` (a rollout's drain, with the tenant's consent): a healthy machine is
    drained, its jobs may finish up to the policy's bound, it leaves the claim (replaced when
    the policy replaces, even a drain-only policy takes it out) and the remediation ends there:
    no repair."""
    p = PolicyConfig(fatal=fatal, job_wait_s=0)  # type: ignore[arg-type]
    r = replace(rem(policy=p), cause=Cause.FIRMWARE, evidence="firmware rollout R1")
    end, seen = step_through(r, Facts(T0, OK, running_jobs=2))
    tail = ["replace:replace"] if fatal == "replace" else []
    assert seen == ["waiting:none", "drain:drain", "wait-jobs:none", "remove:remove", *tail]
    assert end.step == Step.DONE and end.severity == F and end.evidence == "firmware rollout R1"
    assert (end.replacement == "spare") == (fatal == "replace")
    first = decide(r, Facts(T0, OK))
    assert "with the tenant's consent: firmware rollout R1" in first.reason
    # Jobs may finish first, as for a fault.
    waiting, _ = step_through(replace(r, policy=PolicyConfig(job_wait_s=600)),
                              Facts(T0, OK, running_jobs=1))  # fmt: skip
    assert waiting.step == Step.WAIT_JOBS


def test_a_firmware_drain_of_a_machine_found_fatal_meanwhile_ends_in_repair() -> None:
    r = replace(rem(policy=PolicyConfig(job_wait_s=0)), cause=Cause.FIRMWARE)
    end, seen = step_through(r, Facts(T0, F, "XID 79 now", running_jobs=0))
    assert seen[-2:] == ["replace:replace", "repair:repair"] and end.step == Step.DONE
    p = PolicyConfig(fatal="remove", job_wait_s=0)
    _, seen = step_through(replace(r, policy=p), Facts(T0, F, running_jobs=0))
    assert seen[-2:] == ["remove:remove", "repair:repair"]


def test_nothing_to_do() -> None:
    none = decide(rem(sev=D, policy=PolicyConfig(degraded="none")), Facts(T0, D))
    assert none.next == Step.DONE and "does nothing" in none.reason
    healed = decide(rem(sev=D), Facts(T0, Severity.TRANSIENT))
    assert healed.next == Step.DONE


def test_refusals_name_the_claim_or_the_rack() -> None:
    busy = replace(rem("m0"), step=Step.WAIT_JOBS)
    d = decide(rem("m1"), Facts(T0, F), active=[busy], limits=LimitsConfig(per_claim=1))
    assert d.reason == (
        "m1 waits: claim c1 already has 1 machine(s) in remediation (m0), the limit is 1"
    )
    other = replace(rem("m2", claim="c9"), step=Step.DRAINED)
    d = decide(rem("m1"), Facts(T0, F), active=[other],
               limits=LimitsConfig(per_claim=5, per_rack=1))  # fmt: skip
    assert "rack r1 already has 1 machine(s) in remediation (m2)" in d.reason
    assert decide(rem("m1"), Facts(T0, F), active=[busy, other],
                  limits=LimitsConfig(per_claim=2, per_rack=3)).next == Step.DRAIN  # fmt: skip


def test_a_recorded_replacement_is_never_asked_for_again() -> None:
    r = replace(rem(), step=Step.REPLACE, replacement="spare-7")
    d = decide(r, Facts(T0, F))
    assert (d.action, d.next) == (Action.NONE, Step.REPAIR)
    ask = decide(replace(r, replacement=None), Facts(T0, F))
    with pytest.raises(ValueError, match="already has replacement spare-7"):
        advance(r, replace(ask, action=Action.REPLACE), Facts(T0, F), replacement="spare-8")
    with pytest.raises(ValueError, match="replacement's machine id"):
        advance(replace(r, replacement=None), ask, Facts(T0, F))


def test_drain_reason_is_one_bounded_line() -> None:
    r = replace(rem(), evidence="XID 79\n" + "x" * 500)
    reason = drain_reason(r)
    assert reason.startswith("metald: XID 79 x") and "\n" not in reason and len(reason) == 200
