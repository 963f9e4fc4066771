"""The transition table, exhaustively: every legal transition works, every illegal one is
refused, both in the pure core and when applied to a stored machine (on both backends)."""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from sqlmodel import select

from metald import lifecycle, machines
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


# ---- sets derived from the table -------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
S = State


def test_derived_sets_are_the_ones_the_code_used_to_list() -> None:
    """The sets other modules import from lifecycle.py hold exactly the states they used to
    spell out themselves (so deriving them changed no behaviour)."""
    assert lifecycle.RETRY == {
        S.INSPECT_FAILED: Trigger.INSPECT,
        S.PROVISION_FAILED: Trigger.PROVISION,
        S.WIPE_FAILED: Trigger.WIPE,
        S.JOIN_FAILED: Trigger.JOIN,
    }
    assert lifecycle.OPERATION_FAIL == {
        S.PROVISIONING: Trigger.PROVISION_FAIL,
        S.WIPING: Trigger.WIPE_FAIL,
    }
    assert {S.PROVISIONING, S.WIPING, S.INSPECTING, S.RELEASING} == lifecycle.NETWORK_BOOT
    assert {S.DISCOVERED, S.INSPECTING, S.INSPECT_FAILED} == lifecycle.UNINSPECTED
    assert {S.INSPECTING} == lifecycle.INVENTORY_ACCEPTED
    assert {
        S.MAINTENANCE, S.BROKEN, S.REPAIRING, S.ATTESTATION_FAILED, S.RETIRED
    } == lifecycle.OUT_OF_SERVICE  # fmt: skip
    assert {S.PROVISIONED, S.JOINING, S.JOIN_FAILED, S.ACTIVE} == lifecycle.INSTALLED
    assert {
        S.CLAIMED,
        S.PROVISIONING,
        S.PROVISIONED,
        S.JOINING,
        S.JOIN_FAILED,
        S.ACTIVE,
    } == lifecycle.JOINABLE
    assert {S.PROVISIONED, S.JOIN_FAILED} == lifecycle.JOIN_STARTS
    assert {
        S.PROVISIONED,
        S.ACTIVE,
        S.READY,
        S.PROVISION_FAILED,
        S.WIPE_FAILED,
        S.JOIN_FAILED,
    } == lifecycle.SETTLED


def _state_lists(tree: ast.AST) -> list[int]:
    """Lines of set/tuple/list literals naming two or more states, and of dicts from states to
    triggers: a second copy of what the table already says."""

    def is_state(node: ast.AST | None) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in {"State", "S"}
        )

    def is_trigger(node: ast.AST | None) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in {"Trigger", "T"}
        )

    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
            if sum(is_state(e) for e in node.elts) >= 2:
                found.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(
            is_state(k) and is_trigger(v) for k, v in zip(node.keys, node.values, strict=True)
        ):
            found.append(node.lineno)
    return found


def test_state_sets_live_in_the_lifecycle_table_only() -> None:
    """h11's rule: everything about transitions in one file. No module of the daemon, the API
    or metalctl lists states itself; each imports the set it needs from metald/lifecycle.py."""
    offenders = []
    for path in sorted([*(ROOT / "metald").rglob("*.py"), *(ROOT / "api").rglob("*.py")]):
        if path == ROOT / "metald" / "lifecycle.py" or "migrations" in path.parts:
            continue
        for line in _state_lists(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{path.relative_to(ROOT)}:{line}")
    assert not offenders, "state sets outside metald/lifecycle.py: " + ", ".join(offenders)


def test_readme_lifecycle_diagram_is_drawn_from_the_table() -> None:
    """README.md's lifecycle diagram matches the table (scripts/lifecycle_diagram.py)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "lifecycle_diagram.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
