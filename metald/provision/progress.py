"""What a machine's agent reports while it installs an image or wipes disks.

Every report is a ``provision.progress`` event (phase, percent, bytes, rate). A report with
``done`` or ``error`` also ends the operation with its transition, in the same transaction:
provisioning -> provisioned / provision-failed, wiping -> ready / wipe-failed. A wiped machine
leaves its tenant and claim and loses its boot intent and agent tokens; a failed wipe never
reaches ready.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from sqlmodel import Session, col, select

from metald import machines
from metald.auth import revoke_machine_tokens
from metald.errors import Conflict, Unprocessable
from metald.lifecycle import State, Trigger
from metald.provision.intents import after_provisioned
from metald.store.models import Event, Machine, as_utc, utcnow

#: Longest error text kept on the machine (the event keeps the same).
MAX_ERROR = 1000


@dataclass(frozen=True)
class Progress:
    phase: str
    percent: float | None = None
    bytes: int | None = None
    rate_bps: float | None = None
    done: bool = False
    error: str | None = None


def outcome(state: State, p: Progress) -> tuple[Trigger | None, dict[str, Any]]:
    """Pure: the transition (if any) and column updates a report leads to in ``state``."""
    if state not in (State.PROVISIONING, State.WIPING):
        raise Conflict(
            f"the machine is {state.value}; progress is accepted only while it is "
            "provisioning or wiping"
        )
    if p.done and p.error:
        raise Unprocessable("a report cannot be both done and an error; send one or the other")
    if p.error:
        trig = Trigger.PROVISION_FAIL if state is State.PROVISIONING else Trigger.WIPE_FAIL
        return trig, {"last_error": p.error[:MAX_ERROR]}
    if not p.done:
        return None, {}
    if state is State.PROVISIONING:
        return Trigger.PROVISIONED, {"last_error": None}
    return Trigger.WIPED, {
        "tenant_id": None,
        "claim_id": None,
        "boot_intent": None,
        "last_error": None,
    }


def _recently_reported(session: Session, machine_id: str, phase: str, interval_s: float) -> bool:
    if interval_s <= 0:
        return False
    last = session.exec(
        select(Event)
        .where(Event.machine_id == machine_id, Event.kind == "provision.progress")
        .order_by(col(Event.id).desc())
        .limit(1)
    ).first()
    if last is None or (last.data or {}).get("phase") != phase:
        return False
    at = as_utc(last.at)
    return utcnow() - at < timedelta(seconds=interval_s)


def record_progress(
    session: Session,
    machine_id: str,
    p: Progress,
    *,
    actor: str,
    instance: str | None = None,
    min_interval_s: float = 0.0,
) -> Machine:
    """Store one report (and its transition, if it ends the operation) atomically. A report
    that ends nothing, in the same phase as one stored less than ``min_interval_s`` ago, is
    accepted without an event."""
    m = machines.get_machine(session, machine_id)
    state = State(m.state)
    trigger, updates = outcome(state, p)
    if trigger is None and _recently_reported(session, m.id, p.phase, min_interval_s):
        return m  # accepted, not stored: an agent reporting every second would flood events
    machines.add_event(
        session,
        "provision.progress",
        actor,
        machine_id=m.id,
        tenant_id=m.tenant_id,
        data={k: v for k, v in asdict(p).items() if v is not None and v is not False},
        instance=instance,
    )
    if trigger is None:
        session.commit()
        return m
    if trigger is Trigger.PROVISIONED:
        updates["boot_intent"] = after_provisioned(m.boot_intent)
    if trigger is Trigger.WIPED:
        # The wipe image's token has done its job; nothing may act as this machine now.
        revoke_machine_tokens(session, m.id, commit=False)
    return machines.transition(
        session,
        m.id,
        trigger,
        actor=actor,
        reason=p.error[:MAX_ERROR] if p.error else f"agent reported {p.phase} done",
        expected_version=m.version,
        updates=updates,
        instance=instance,
        machine=m,
    )
