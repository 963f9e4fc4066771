"""The transition table, exhaustively: every legal transition works, every illegal one is
refused, both in the pure core and when applied to a stored machine (on both backends)."""

from __future__ import annotations

import itertools

import pytest
from sqlmodel import select

from metald import machines
from metald.lifecycle import ALLOCATED, TRANSITIONS, IllegalTransition, State, Trigger, next_state
from metald.store.models import Event, Machine

ALL_PAIRS = list(itertools.product(State, Trigger))


def test_table_covers_required_states() -> None:
    targets = set(TRANSITIONS.values()) | {src for src, _ in TRANSITIONS}
    assert targets == set(State), "every state is reachable or leavable"
    # Every state except retired can be left; retired is terminal.
    leavable = {src for src, _ in TRANSITIONS}
    assert leavable == set(State) - {State.RETIRED}


@pytest.mark.parametrize(("state", "trigger"), ALL_PAIRS, ids=lambda x: x.value)
def test_pure_core(state: State, trigger: Trigger) -> None:
    if (state, trigger) in TRANSITIONS:
        assert next_state(state, trigger) is TRANSITIONS[(state, trigger)]
    else:
        with pytest.raises(IllegalTransition) as e:
            next_state(state, trigger)
        assert state.value in str(e.value) and trigger.value in str(e.value)


def test_allocated_machine_cannot_be_retired_with_hint() -> None:
    with pytest.raises(IllegalTransition, match="release it first"):
        next_state(State.ACTIVE, Trigger.RETIRE)


def test_every_pair_applied_to_stored_machine(store) -> None:  # type: ignore[no-untyped-def]
    """All 323 (state, trigger) pairs against the database: legal ones change the state and
    write exactly one event; illegal ones leave the row and the event log untouched."""
    with store.session() as s:
        m = machines.create_machine(s, macs=["02:00:00:00:00:01"], actor="test")
        for state, trigger in ALL_PAIRS:
            s.execute(
                Machine.__table__.update().where(Machine.id == m.id).values(state=state.value)
            )  # type: ignore[attr-defined]
            s.commit()
            before = s.exec(select(Event).where(Event.machine_id == m.id)).all()
            version = s.get(Machine, m.id).version  # type: ignore[union-attr]
            if (state, trigger) in TRANSITIONS:
                out = machines.transition(s, m.id, trigger, actor="test", reason="table")
                assert out.state == TRANSITIONS[(state, trigger)].value
                assert out.version == version + 1
                events = s.exec(select(Event).where(Event.machine_id == m.id)).all()
                assert len(events) == len(before) + 1
                last = events[-1]
                assert (last.from_state, last.to_state, last.actor) == (
                    state.value,
                    out.state,
                    "test",
                )
            else:
                with pytest.raises(IllegalTransition):
                    machines.transition(s, m.id, trigger, actor="test")
                s.rollback()
                row = s.get(Machine, m.id)
                s.refresh(row)
                assert row.state == state.value and row.version == version  # type: ignore[union-attr]
                assert len(s.exec(select(Event).where(Event.machine_id == m.id)).all()) == len(
                    before
                )


def test_allocated_set_is_release_sources() -> None:
    assert {s for (s, t) in TRANSITIONS if t is Trigger.RELEASE} == set(ALLOCATED)


def test_a_machine_owing_a_wipe_reaches_ready_only_wiped_or_confirmed() -> None:
    from metald.lifecycle import GuardRefused, check_guards

    for state, trigger in (
        ("maintenance", "maintenance-off"),
        ("maintenance", "inspect"),
    ):
        with pytest.raises(GuardRefused, match="has not been wiped"):
            check_guards(state, trigger, tenant_attached=False, wipe_owed=True)
    check_guards("wiping", "wiped", tenant_attached=True, wipe_owed=True)
    for state in ("releasing", "wiping", "wipe-failed", "maintenance"):
        assert next_state(state, "confirm-wipe") is State.READY
        check_guards(state, "confirm-wipe", tenant_attached=False, wipe_owed=True)
    check_guards("maintenance", "maintenance-off", tenant_attached=False, wipe_owed=False)
    assert next_state("maintenance", "wipe") is State.WIPING


def test_a_tenants_broken_machine_is_not_repaired_before_release() -> None:
    from metald.lifecycle import GuardRefused, check_guards

    for trigger in ("repair", "maintenance-on", "retire"):
        with pytest.raises(GuardRefused, match="release the claim"):
            check_guards("broken", trigger, tenant_attached=True, wipe_owed=True)
    check_guards("active", "mark-broken", tenant_attached=True, wipe_owed=True)
    check_guards("broken", "repair", tenant_attached=False, wipe_owed=True)


def test_every_state_has_at_most_one_phase_and_wipes_are_never_armed_on_entry() -> None:
    from metald.lifecycle import ALLOCATED, PHASES, boot_on_entry, phase_of

    assert {phase_of(s) for s in ALLOCATED} == {"provision"}
    assert phase_of(State.READY) == "inspect" and phase_of(State.WIPING) == "wipe"
    assert phase_of(State.BROKEN) is None and State.MAINTENANCE not in PHASES
    assert boot_on_entry(State.INSPECTING, lambda: "n") == {"boot_armed": "n"}
    assert boot_on_entry(State.PROVISIONING, lambda: "n") == {"boot_armed": "n"}
    assert boot_on_entry(State.WIPING, lambda: "n") == {"boot_armed": None}
    assert boot_on_entry(State.ACTIVE, lambda: "n") == {}
