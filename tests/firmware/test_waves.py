"""The rollout's decisions (``metald.firmware.waves``), pure: driven through whole rollouts
with random outcomes, machines taken and released by tenants (who consent to drains or not),
pauses and aborts."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from metald.firmware.waves import (
    ENDED,
    FINAL,
    Availability,
    InUse,
    Policy,
    RolloutState,
    Target,
    TargetStatus,
    plan,
)

A, TS, RS = Availability, TargetStatus, RolloutState


def _targets(
    n: int,
    busy: set[int] = frozenset(),  # type: ignore[assignment]
    consent: set[int] = frozenset(),  # type: ignore[assignment]
) -> list[Target]:
    return [
        Target(f"m{i}", TS.PENDING, None, A.BUSY if i in busy else A.FREE, consent=i in consent)
        for i in range(n)
    ]


def _apply(targets: list[Target], p: object) -> list[Target]:
    out = []
    for t in targets:
        if t.machine_id in p.join:  # type: ignore[attr-defined]
            t = replace(t, wave=p.wave, status=TS.PENDING)  # type: ignore[attr-defined]
        if t.machine_id in dict(p.skip):  # type: ignore[attr-defined]
            t = replace(t, status=TS.SKIPPED)
        if t.machine_id in p.wait:  # type: ignore[attr-defined]
            t = replace(t, status=TS.WAITING, wave=None)
        if t.machine_id in p.drain:  # type: ignore[attr-defined]
            t = replace(t, status=TS.DRAINING, wave=None)
        if t.machine_id in p.start:  # type: ignore[attr-defined]
            t = replace(t, status=TS.UPDATING)
        out.append(t)
    return out


def test_first_wave_and_cap() -> None:
    p = plan(RS.RUNNING, Policy(3, 2, 1), _targets(5))
    assert p.join == ["m0", "m1", "m2"] and p.wave == 1
    assert p.start == ["m0", "m1"]


def test_budget_of_one_stops_at_the_first_failure() -> None:
    ts = _targets(4)
    ts[0] = replace(ts[0], status=TS.FAILED, wave=1)
    ts[1] = replace(ts[1], status=TS.UPDATING, wave=1)
    p = plan(RS.RUNNING, Policy(2, 2, 1), ts)
    assert p.state is RS.STOPPED and not p.start and not p.join
    assert "failure budget of 1" in (p.reason or "") and "m0" in (p.reason or "")


def test_in_use_skip_or_wait() -> None:
    ts = _targets(3, busy={1})
    assert plan(RS.RUNNING, Policy(3, 3, 1, InUse.SKIP), ts).skip[0][0] == "m1"
    p = plan(RS.RUNNING, Policy(3, 3, 1, InUse.WAIT), ts)
    assert p.wait == ["m1"] and "m1" not in p.join and not p.skip


def test_in_use_drain_with_consent_else_wait() -> None:
    ts = _targets(3, busy={0, 1}, consent={1})
    p = plan(RS.RUNNING, Policy(3, 3, 1, InUse.DRAIN), ts)
    assert p.drain == ["m1"] and p.wait == ["m0"] and p.join == ["m2"] and not p.skip
    # Draining, then back in the pool (released, wiped): it joins the next wave and starts.
    ts = _apply(ts, p)
    assert plan(RS.RUNNING, Policy(3, 3, 1, InUse.DRAIN), ts).drain == []  # once
    ts[1] = replace(ts[1], available=A.FREE)
    ts[2] = replace(ts[2], status=TS.DONE)
    p = plan(RS.RUNNING, Policy(3, 3, 1, InUse.DRAIN), ts)
    assert p.join == ["m1"] and p.start == ["m1"]
    # Consent given while waiting: drained then.
    ts[0] = replace(ts[0], consent=True)
    assert plan(RS.RUNNING, Policy(3, 3, 1, InUse.DRAIN), ts).drain == ["m0"]
    # The wait policy never drains, consent or not.
    assert plan(RS.RUNNING, Policy(3, 3, 1, InUse.WAIT), ts).drain == []


def test_paused_and_aborted_start_nothing() -> None:
    for state in (RS.PAUSED, RS.ABORTED, RS.STOPPED):
        assert plan(state, Policy(2, 2, 1), _targets(3)).start == []


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 12),
    batch=st.integers(1, 5),
    cap=st.integers(1, 5),
    budget=st.integers(1, 4),
    in_use=st.sampled_from(list(InUse)),
    steps=st.lists(
        st.tuples(
            st.integers(0, 11),
            st.sampled_from(
                ["done", "fail", "take", "free", "gone", "consent", "pause", "resume", "abort"]
            ),
        ),
        max_size=80,
    ),
    busy=st.sets(st.integers(0, 11), max_size=4),
    consent=st.sets(st.integers(0, 11), max_size=4),
)
def test_rollout_invariants(
    n: int,
    batch: int,
    cap: int,
    budget: int,
    in_use: InUse,
    steps: list[tuple[int, str]],
    busy: set[int],
    consent: set[int],
) -> None:
    policy = Policy(batch, cap, budget, in_use)
    ts = _targets(n, busy, consent)
    state = RS.RUNNING
    started_after_trip = False

    def step() -> None:
        nonlocal ts, state, started_after_trip
        p = plan(state, policy, ts)
        failed = sum(t.status is TS.FAILED for t in ts)
        by_id = {t.machine_id: t for t in ts}
        for m in p.start:  # only free, pending machines of the open wave start
            assert by_id[m].available is A.FREE
            assert by_id[m].status in (TS.PENDING, TS.WAITING, TS.DRAINING)
        if p.start and (state is not RS.RUNNING or failed >= budget):
            started_after_trip = True
        assert len(p.join) <= batch
        if in_use is InUse.SKIP:
            assert not p.wait
        for m in p.drain:  # only machines in use whose tenant consented, by the drain policy
            assert in_use is InUse.DRAIN and by_id[m].consent
            assert by_id[m].available is A.BUSY and by_id[m].status is not TS.DRAINING
        if state is not RS.RUNNING:
            assert not p.drain
        ts = _apply(ts, p)
        state = p.state
        updating = [t for t in ts if t.status is TS.UPDATING]
        assert len(updating) <= cap
        # One wave at a time.
        assert len({t.wave for t in updating}) <= 1
        if failed >= budget:
            assert state in (RS.STOPPED, RS.ABORTED, RS.DONE)

    for i, what in steps:
        step()
        if i >= n:
            continue
        t = ts[i]
        if what == "done" and t.status is TS.UPDATING:
            ts[i] = replace(t, status=TS.DONE)
        elif what == "fail" and t.status is TS.UPDATING:
            ts[i] = replace(t, status=TS.FAILED)
        elif what == "take" and t.status not in (TS.UPDATING, *FINAL):
            ts[i] = replace(t, available=A.BUSY)
        elif what == "free":
            ts[i] = replace(t, available=A.FREE)
        elif what == "consent":
            ts[i] = replace(t, consent=not t.consent)
        elif what == "gone" and t.status not in (TS.UPDATING, *FINAL):
            ts[i] = replace(t, available=A.GONE)
        elif what == "pause" and state is RS.RUNNING:
            state = RS.PAUSED
        elif what == "resume" and state is RS.PAUSED:
            state = RS.RUNNING
        elif what == "abort" and state not in ENDED:
            state = RS.ABORTED
    assert not started_after_trip
    # Left alone with every machine free and every flash succeeding, it ends.
    if state is RS.PAUSED:
        state = RS.RUNNING
    ts = [replace(t, available=A.FREE) if t.available is A.BUSY else t for t in ts]
    for _ in range(4 * n + 4):
        step()
        ts = [replace(t, status=TS.DONE) if t.status is TS.UPDATING else t for t in ts]
    step()
    assert state in ENDED
    if state is RS.DONE:
        assert all(t.status in FINAL for t in ts)
        assert sum(t.status is TS.FAILED for t in ts) < budget
