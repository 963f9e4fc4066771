"""The repair queue: a machine with a fault a person must fix, from the queue to the pool.

A repair is opened by a remediation (a fatal fault on a machine in use: the machine was taken
out of its claim and replaced), by a technician (by hand, instead of a bare ``mark-broken``),
or for a machine that failed commissioning. Opening it marks the machine broken. Then:

    open --take--> taken (machine: repairing) --repaired--> verifying
      verifying --commissioning passed--> closed, returned (machine: ready)
      verifying --commissioning failed--> open again (machine: broken), one failure counted
      verifying --failed the second time--> closed, out (machine: broken, with the sentence)

"repaired" sends the machine through the commissioning flow
(``metald.provision.commissioning``): inspected again with a run requested or, when a
tenant's data is still on its disks, wiped first (the wipe's end starts the run). That flow
calls ``verification_ended`` where a run finishes and where the watchdog gives up on it.

Every function takes an open ``Session``; state changes go through ``metald.machines`` and
every step writes an event (``repair.*``). Repair events carry no tenant: technicians' notes
are staff business (the tenant sees its machine's own state changes and the remediation's
events on its claim). The repair row is compare-and-swapped on ``version``, and one machine has
at most one open repair (a unique column), so two technicians racing get one winner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import bindparam
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from metald import machines
from metald.errors import Conflict, Forbidden, NotFound, Unprocessable
from metald.health.parts import locate
from metald.lifecycle import IN_REPAIR, State, Trigger
from metald.store.models import Machine, Repair, utcnow

#: Fault records kept per repair (a flapping witness cannot grow a row without bound).
MAX_FAULTS = 20
#: Characters of evidence kept per fault, and of one note.
MAX_EVIDENCE, MAX_NOTE = 500, 2000
#: Notes kept per repair.
MAX_NOTES = 100
#: Failed commissioning runs after repair that keep a machine out of the pool.
MAX_FAILURES = 2

_SEVERITY_RANK = {"ok": 0, "transient": 1, "degraded": 2, "fatal": 3}


class Status(StrEnum):
    OPEN = "open"  # in the queue: nobody works on it
    TAKEN = "taken"  # a technician works on it; the machine is repairing
    VERIFYING = "verifying"  # repaired: wipe and commissioning under way
    CLOSED = "closed"


class Source(StrEnum):
    REMEDIATION = "remediation"
    TECHNICIAN = "technician"
    COMMISSIONING = "commissioning"
    #: Held at a release: firmware changed during the tenancy that metald cannot restore, or
    #: a BMC clean-up step that failed (metald.firmware.release).
    RELEASE = "release"


class Outcome(StrEnum):
    RETURNED = "returned"  # commissioning passed after repair: ready
    OUT = "out"  # failed commissioning MAX_FAILURES times after repair: stays out
    RETIRED = "retired"  # the machine was retired while the repair was open


#: Statuses of a repair that is not closed.
OPEN_STATUSES = frozenset({Status.OPEN, Status.TAKEN, Status.VERIFYING})


def fault_record(fault: Any, *, at: datetime | None = None) -> dict[str, Any]:
    """A fault as the repair keeps it, from a dict, a dataclass or a model with at least kind,
    subject, code, severity, witness, evidence and first_seen (``rule``, ``why`` and ``part``
    kept when present). Bounded: evidence to MAX_EVIDENCE characters, every other field to 200."""
    if isinstance(fault, Mapping):
        raw = dict(fault)
    elif dataclasses.is_dataclass(fault) and not isinstance(fault, type):
        raw = {f.name: getattr(fault, f.name) for f in dataclasses.fields(fault)}
    elif hasattr(fault, "model_dump"):
        raw = fault.model_dump()
    else:
        raw = {k: getattr(fault, k) for k in dir(fault) if not k.startswith("_")}
    # A classified signal (metald.health.classify.Classified) carries its signal inside.
    signal = raw.get("signal")
    if signal is not None and not isinstance(signal, Mapping):
        for k in ("kind", "subject", "code", "witness", "evidence"):
            raw.setdefault(k, getattr(signal, k, None))
        raw.setdefault("first_seen", getattr(signal, "at", None))

    def text(name: str, limit: int = 200) -> str | None:
        v = raw.get(name)
        if v is None:
            return None
        v = getattr(v, "value", v)
        s = v.isoformat() if isinstance(v, datetime) else str(v)
        return s if len(s) <= limit else s[: limit - 3] + "..."

    out = {
        "kind": text("kind") or "unknown",
        "subject": text("subject") or "node",
        "code": text("code") or "",
        "severity": (text("severity") or "fatal").lower(),
        "witness": text("witness") or "unknown",
        "evidence": text("evidence", MAX_EVIDENCE) or "",
        "first_seen": text("first_seen") or (at or utcnow()).isoformat(),
    }
    for extra in ("rule", "why", "part"):
        if raw.get(extra):
            out[extra] = text(extra)
    return out


def summarise(faults: Sequence[Mapping[str, Any]]) -> str:
    """The worst fault in a sentence."""
    if not faults:
        return "no fault recorded"
    worst = max(faults, key=lambda f: _SEVERITY_RANK.get(str(f.get("severity")), 0))
    what = worst.get("why") or worst.get("code") or worst.get("kind")
    more = f" (+{len(faults) - 1} more)" if len(faults) > 1 else ""
    s = f"{worst['severity']} {worst['kind']} on {worst['subject']}: {what}{more}"
    return s[:300]


def parts_of(
    faults: Sequence[Mapping[str, Any]], inventory: Mapping[str, Any] | None
) -> list[dict[str, Any]]:
    """Where to look, one entry per distinct part (``metald.health.parts.locate``)."""
    out: list[dict[str, Any]] = []
    for f in faults:
        p = locate(f, inventory)
        if p not in out:
            out.append(p)
    return out


def _normalized(s: Session, machine_id: str) -> dict[str, Any] | None:
    inv = s.exec(select(Machine.inventory).where(Machine.id == machine_id)).first()
    return (inv or {}).get("normalized") if isinstance(inv, dict) else None


def get(s: Session, repair_id: str) -> Repair:
    r = s.exec(_BY_ID, params={"id": repair_id}).first()  # type: ignore[call-overload]
    if r is None:
        raise NotFound(f"no repair with id {repair_id!r}")
    return r  # type: ignore[no-any-return]


_BY_ID = (
    select(Repair).where(Repair.id == bindparam("id")).execution_options(populate_existing=True)
)


def open_of(s: Session, machine_id: str) -> Repair | None:
    """The machine's repair that is not closed, if any."""
    return s.exec(
        select(Repair)
        .where(Repair.open_machine_id == machine_id)
        .execution_options(populate_existing=True)
    ).first()


def last_of(s: Session, machine_id: str) -> Repair | None:
    """The machine's newest repair."""
    return s.exec(
        select(Repair).where(Repair.machine_id == machine_id).order_by(col(Repair.opened_at).desc())
    ).first()


def _event(
    s: Session, kind: str, actor: str, r: Repair, reason: str, instance: str | None, **data: Any
) -> None:
    machines.add_event(
        s,
        f"repair.{kind}",
        actor,
        machine_id=r.machine_id,
        reason=reason[:500],
        data={"repair": r.id, "status": r.status, **data},
        instance=instance,
    )


def _save(s: Session, r: Repair, version: int, **values: Any) -> Repair:
    """Compare-and-swap the repair's columns: of two writers racing, one wins."""
    values = {**values, "version": version + 1}
    res = s.connection().execute(
        _REPAIRS.update().where(_REPAIRS.c.id == r.id, _REPAIRS.c.version == version),
        values,
    )
    if res.rowcount != 1:
        s.rollback()
        raise Conflict(f"repair {r.id} was changed by someone else at the same time; read it again")
    s.expire(r)
    return r


_REPAIRS = Repair.__table__  # type: ignore[attr-defined]


def open_repair(
    s: Session,
    machine_id: str,
    *,
    faults: Sequence[Any],
    source: Source | str,
    actor: str,
    remediation_id: str | None = None,
    instance: str | None = None,
    commit: bool = True,
) -> Repair:
    """Put the machine in the repair queue with its faults, and mark it broken.

    Idempotent for a remediation (its id is the key: the same remediation opens one repair,
    however often it retries). A machine that already has an open repair gets the new faults
    added to it (bounded by MAX_FAULTS) instead of a second one. A retired machine is refused.
    ``commit=False`` leaves the commit to the caller's transaction."""
    source = Source(source)
    if remediation_id is not None:
        done = s.exec(select(Repair).where(Repair.remediation_id == remediation_id)).first()
        if done is not None:
            if done.machine_id != machine_id:
                raise Conflict(
                    f"remediation {remediation_id} already opened repair {done.id} for machine "
                    f"{done.machine_id}, not {machine_id}"
                )
            return done
    m = machines.get_machine(s, machine_id)
    if State(m.state) is State.RETIRED:
        raise Conflict(f"machine {machine_id} is retired; a retired machine is not repaired")
    now = utcnow()
    records = [fault_record(f, at=now) for f in faults]
    if not records:
        raise Unprocessable("a repair needs at least one fault: say what is wrong")
    current = open_of(s, machine_id)
    if current is not None:
        known = {(f["kind"], f["subject"], f["code"]) for f in current.faults}
        new = [f for f in records if (f["kind"], f["subject"], f["code"]) not in known]
        kept = (list(current.faults) + new)[:MAX_FAULTS]
        added = kept[len(current.faults) :]
        if added:
            _save(
                s,
                current,
                current.version,
                faults=kept,
                summary=summarise(kept),
                parts=parts_of(kept, _normalized(s, machine_id)),
            )
            _event(
                s, "faults", actor, current, f"{len(added)} more fault(s): {summarise(added)}",
                instance, remediation=remediation_id, dropped=len(new) - len(added),
            )  # fmt: skip
        if commit:
            s.commit()
        return current
    kept = records[:MAX_FAULTS]
    r = Repair(
        machine_id=machine_id,
        open_machine_id=machine_id,
        status=Status.OPEN.value,
        source=source.value,
        remediation_id=remediation_id,
        opened_by=actor,
        opened_at=now,
        summary=summarise(kept),
        faults=kept,
        parts=parts_of(kept, _normalized(s, machine_id)),
    )
    try:
        with s.begin_nested():
            s.add(r)
            s.flush()
    except IntegrityError:
        # Someone opened one for this machine (or this remediation) a moment ago.
        raise Conflict(
            f"machine {machine_id} got a repair from someone else at the same moment; "
            "list its repairs and add to that one"
        ) from None
    if State(m.state) not in IN_REPAIR:
        machines.transition(
            s,
            machine_id,
            Trigger.MARK_BROKEN,
            actor=actor,
            reason=f"repair opened ({source.value}): {r.summary}"[:500],
            data={"repair": r.id},
            updates={"last_error": f"in repair: {r.summary}"[:1000]},
            instance=instance,
            commit=False,
            machine=m,
        )
    _event(
        s, "opened", actor, r, f"opened ({source.value}): {r.summary}", instance,
        source=source.value, remediation=remediation_id, faults=len(records),
        dropped=len(records) - len(kept),
    )  # fmt: skip
    if commit:
        s.commit()
    return r


#: Technician actions that would take a machine out of broken towards the pool by hand.
_OUT_OF_BROKEN = frozenset({"repair", "maintenance-on"})


def check_manual(s: Session, machine_id: str, action: str, *, admin: bool) -> None:
    """Refuse a technician's direct action on a machine the queue holds, so nothing reaches
    the pool around commissioning: while a repair is open only the queue moves the machine
    (retire excepted); a machine whose last repair ended ``out`` leaves broken only by an
    admin's hand."""
    if action == "retire":
        return
    r = open_of(s, machine_id)
    if r is not None:
        raise Conflict(
            f"machine {machine_id} is in repair {r.id} ({r.status}); work through the repair "
            f"queue (take it, then mark it repaired: POST /api/v1/repairs/{r.id}/take, "
            ".../repaired): commissioning returns it to the pool"
        )
    last = last_of(s, machine_id)
    if action in _OUT_OF_BROKEN and not admin and last is not None and last.outcome == Outcome.OUT:
        raise Forbidden(
            f"machine {machine_id} failed commissioning {last.commission_failures} times after "
            f"repair {last.id} and stays out of the pool; only an admin can {action} it"
        )


def take(s: Session, repair_id: str, *, actor: str, instance: str | None = None) -> Repair:
    """A technician takes the repair: the machine goes from broken to repairing (out of
    service, powered off by its agent if one still runs). One winner of two racing."""
    r = get(s, repair_id)
    if r.status != Status.OPEN:
        who = f" by {r.taken_by}" if r.taken_by else ""
        raise Conflict(f"repair {r.id} is {r.status}{who}; only an open repair can be taken")
    m = machines.get_machine(s, r.machine_id)
    if State(m.state) is not State.REPAIRING:
        machines.transition(
            s,
            r.machine_id,
            Trigger.TAKE_REPAIR,
            actor=actor,
            reason=f"repair taken: {r.summary}"[:500],
            data={"repair": r.id},
            instance=instance,
            commit=False,
            machine=m,
        )
    now = utcnow()
    _save(s, r, r.version, status=Status.TAKEN.value, taken_by=actor, taken_at=now)
    _event(s, "taken", actor, r, f"taken by {actor}", instance)
    s.commit()
    return r


def release(
    s: Session, repair_id: str, *, actor: str, admin: bool, instance: str | None = None
) -> Repair:
    """The technician lets go of a taken repair without fixing it (the part is not in, the
    shift ends): the repair is open in the queue again for anyone to take, the machine broken
    again (out of service, as when it was queued). Only the one who took it, or an admin."""
    r = get(s, repair_id)
    if r.status != Status.TAKEN:
        raise Conflict(f"repair {r.id} is {r.status}; only a taken repair can be released")
    if r.taken_by != actor and not admin:
        raise Forbidden(
            f"repair {r.id} is taken by {r.taken_by}; only they or an admin can release it"
        )
    m = machines.get_machine(s, r.machine_id)
    if State(m.state) is State.REPAIRING:
        machines.transition(
            s,
            r.machine_id,
            Trigger.MARK_BROKEN,
            actor=actor,
            reason=f"repair {r.id} released by {actor}: back in the queue"[:500],
            data={"repair": r.id},
            updates={"last_error": f"in repair: {r.summary}"[:1000]},
            instance=instance,
            commit=False,
            machine=m,
        )
    was = r.taken_by
    _save(s, r, r.version, status=Status.OPEN.value, taken_by=None, taken_at=None)
    _event(s, "released", actor, r, f"released by {actor} (taken by {was}): back in the queue",
           instance, taken_by=was)  # fmt: skip
    s.commit()
    return r


def add_note(
    s: Session, repair_id: str, text: str, *, actor: str, instance: str | None = None
) -> Repair:
    """A technician's note (what was found, what was swapped), kept with who and when."""
    r = get(s, repair_id)
    text = " ".join(text.split()) if "\n" not in text else text.strip()
    if not text:
        raise Unprocessable("a note needs some text")
    if len(text) > MAX_NOTE:
        raise Unprocessable(f"a note holds at most {MAX_NOTE} characters; split it")
    if len(r.notes) >= MAX_NOTES:
        raise Conflict(
            f"repair {r.id} already holds {MAX_NOTES} notes; open a new repair for new work"
        )
    note = {"at": utcnow().isoformat(), "by": actor, "text": text}
    _save(s, r, r.version, notes=[*r.notes, note])
    _event(s, "note", actor, r, f"note by {actor}", instance, chars=len(text))
    s.commit()
    return r


def mark_verifying(
    s: Session,
    repair_id: str,
    machine: Machine,
    *,
    actor: str,
    note: str | None,
    instance: str | None,
) -> Repair:
    """In "repaired"'s transaction, before the machine leaves repairing for its wipe or its
    commissioning: the repair waits for commissioning's verdict. No commit."""
    r = get(s, repair_id)
    if r.machine_id != machine.id:
        raise NotFound(f"no repair {repair_id!r} on machine {machine.id}")
    if r.status != Status.TAKEN or State(machine.state) is not State.REPAIRING:
        raise Conflict(
            f"repair {r.id} is {r.status} and its machine {machine.state}; only a taken repair "
            "(machine repairing) can be marked repaired: take it first"
        )
    notes = list(r.notes)
    if note:
        if len(note) > MAX_NOTE:
            raise Unprocessable(f"a note holds at most {MAX_NOTE} characters; split it")
        notes = [*notes, {"at": utcnow().isoformat(), "by": actor, "text": note.strip()}][
            -MAX_NOTES:
        ]
    _save(
        s, r, r.version, status=Status.VERIFYING.value, repaired_by=actor,
        repaired_at=utcnow(), notes=notes,
    )  # fmt: skip
    via = "wipe, then commissioning" if machine.wipe_required else "commissioning"
    _event(s, "repaired", actor, r, f"marked repaired by {actor}; verifying by {via}", instance)
    return r


def verifying(s: Session, machine_id: str) -> Repair | None:
    """The machine's repair waiting for commissioning's verdict, if any."""
    r = open_of(s, machine_id)
    return r if r is not None and r.status == Status.VERIFYING else None


def verification_ended(
    s: Session,
    m: Machine,
    *,
    passed: bool,
    why: str,
    actor: str,
    instance: str | None = None,
) -> Repair | None:
    """Commissioning's verdict on a machine (called where a run finishes, and where the
    watchdog gives up on an inspection or commissioning): for a machine whose repair is
    verifying, a pass closes the repair (the machine is ready); a failure counts, marks the
    machine broken and puts the repair back in the queue, and the MAX_FAILURES-th failure
    closes it as out with a sentence on the machine. No commit; None without such a repair."""
    r = verifying(s, m.id)
    if r is None:
        return None
    now = utcnow()
    if passed:
        reason = f"commissioning passed after repair: back in the pool ({why})"[:500]
        _save(
            s, r, r.version, status=Status.CLOSED.value, open_machine_id=None, closed_at=now,
            outcome=Outcome.RETURNED.value, outcome_reason=reason,
        )  # fmt: skip
        _event(s, "returned", actor, r, reason, instance)
        return r
    failures = r.commission_failures + 1
    if failures >= MAX_FAILURES:
        reason = (
            f"failed commissioning {failures} times after repair (last: {why}); it stays out "
            f"of the pool: replace the part repair {r.id} names and have an admin open a new "
            "repair, or retire it"
        )[:1000]
        status: dict[str, Any] = {
            "status": Status.CLOSED.value, "open_machine_id": None, "closed_at": now,
            "outcome": Outcome.OUT.value, "outcome_reason": reason,
        }  # fmt: skip
        kind = "out"
    else:
        reason = (
            f"commissioning failed after repair ({failures} of {MAX_FAILURES} allowed): {why}; "
            "back in the repair queue"
        )[:1000]
        status = {"status": Status.OPEN.value}
        kind = "failed"
    machines.transition(
        s,
        m.id,
        Trigger.MARK_BROKEN,
        actor=actor,
        reason=reason[:500],
        data={"repair": r.id, "commission_failures": failures},
        updates={"last_error": reason},
        instance=instance,
        commit=False,
        machine=m,
    )
    _save(s, r, r.version, commission_failures=failures, **status)
    _event(s, kind, actor, r, reason, instance, commission_failures=failures)
    return r


def retired(s: Session, m: Machine, *, actor: str, instance: str | None = None) -> None:
    """The machine was retired: its open repair ends with it. No commit."""
    r = open_of(s, m.id)
    if r is None:
        return
    reason = "the machine was retired"
    _save(
        s, r, r.version, status=Status.CLOSED.value, open_machine_id=None, closed_at=utcnow(),
        outcome=Outcome.RETIRED.value, outcome_reason=reason,
    )  # fmt: skip
    _event(s, "closed", actor, r, reason, instance)
