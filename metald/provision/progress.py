"""What a machine's agent reports while it installs an image or wipes disks.

Every report is a ``provision.progress`` event (phase, percent, bytes, rate). A report with
``done`` or ``error`` also ends the operation with its transition, in the same transaction:
provisioning -> provisioned / provision-failed, wiping -> ready / wipe-failed. A wiped machine
leaves its tenant and claim and loses its boot intent and agent tokens; a failed wipe never
reaches ready. A wipe is accepted as done only from the token of the boot metald started for
it (``metald.provision.boots``) and with per-disk evidence that fits the machine's recorded
disks (``metald.provision.wipe``); a refused report is recorded as ``wipe.refused`` and the
machine stays wiping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from sqlmodel import Session, col, select

from metald import machines
from metald.auth import revoke_machine_tokens
from metald.errors import Conflict, Forbidden, MetaldError, Unprocessable
from metald.lifecycle import AGENT_OPERATIONS, OPERATION_FAIL, State, Trigger
from metald.provision.attestation import wipe_hold
from metald.provision.intents import after_provisioned
from metald.provision.wipe import evidence_problems, recorded_disks
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
    #: Wipe reports: per-disk evidence (``metald.provision.wipe``).
    disks: list[dict[str, Any]] | None = None


class WipeRefused(Conflict):
    title = "Wipe not accepted"


def check_wipe_done(
    p: Progress, *, token_boot: str | None, machine_boot: str | None, recorded: dict[str, int]
) -> None:
    """Pure: refuse a wipe-done report from a token of a boot metald did not start (403) or
    without evidence fitting the recorded disks (409)."""
    if token_boot is None or token_boot != machine_boot:
        raise Forbidden(
            "a wipe is accepted only from the agent of the wipe boot metald started (its token "
            "came with that boot's script); this token was not, so the machine stays wiping. "
            "Retry the wipe if it failed, or have a technician confirm it"
        )
    problems = evidence_problems(p.disks, recorded)
    if problems:
        raise WipeRefused(
            "the wipe report does not show this machine's disks wiped, so it stays wiping: "
            + "; ".join(problems)[:800],
            problems=problems,
        )


def outcome(state: State, p: Progress) -> tuple[Trigger | None, dict[str, Any]]:
    """Pure: the transition (if any) and column updates a report leads to in ``state``."""
    if state not in AGENT_OPERATIONS:
        raise Conflict(
            f"the machine is {state.value}; progress is accepted only while it is "
            "provisioning or wiping"
        )
    if p.done and p.error:
        raise Unprocessable("a report cannot be both done and an error; send one or the other")
    if p.error:
        trig = OPERATION_FAIL[state]
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
        "wipe_required": False,
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
    token_boot: str | None = None,
    on_wiped: Callable[[Session, Machine], object] | None = None,
) -> Machine:
    """Store one report (and its transition, if it ends the operation) atomically. A report
    that ends nothing, in the same phase as one stored less than ``min_interval_s`` ago, is
    accepted without an event. ``token_boot``: the boot the reporting token was minted for.
    ``on_wiped`` runs in the wipe's transaction after ``wiped`` (commissioning on release)."""
    m = machines.get_machine(session, machine_id)
    state = State(m.state)
    trigger, updates = outcome(state, p)
    if trigger is Trigger.WIPED:
        try:
            check_wipe_done(
                p,
                token_boot=token_boot,
                machine_boot=m.boot_current,
                recorded=recorded_disks(m.inventory),
            )
        except MetaldError as e:
            session.rollback()
            machines.add_event(
                session,
                "wipe.refused",
                actor,
                machine_id=m.id,
                reason=e.detail[:1000],
                data={"status": e.status, "disks": p.disks},
                instance=instance,
            )
            session.commit()
            raise
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
    reason = p.error[:MAX_ERROR] if p.error else f"agent reported {p.phase} done"
    if trigger is Trigger.WIPED:
        # The disks are clean either way; what booted may not be what booted last time.
        hold = wipe_hold(session, m, token_boot)
        if hold is not None:
            trigger, reason = Trigger.ATTEST_FAIL, f"wiped, but held: {hold}"[:MAX_ERROR]
            updates["last_error"] = reason
    then = on_wiped if trigger is Trigger.WIPED else None
    m = machines.transition(
        session,
        m.id,
        trigger,
        actor=actor,
        reason=reason,
        expected_version=m.version,
        updates=updates,
        instance=instance,
        machine=m,
        commit=then is None,
    )
    if then is not None:
        then(session, m)
        session.commit()
    return m
