"""A machine's faults in the store: the open ``health_faults`` rows are its
``metald.health.trust.Health``; new signals are folded under the trust rule and the difference
is written back (new faults, worse or later ones, cleared ones), each new or cleared fault an
event on the machine and, while it is in a claim, on the claim's tenant stream."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlmodel import Session, col, select

from metald import machines
from metald.health.classify import Classified, Severity
from metald.health.signals import Kind, Witness
from metald.health.trust import Fault, FaultKey, Health, expire, fold
from metald.store.models import HealthFault, Machine, as_utc


def open_key(machine_id: str, key: FaultKey) -> str:
    witness, kind, subject, rule = key
    return "\x1f".join((machine_id, witness, kind, subject[:200], rule))


def _fault(r: HealthFault) -> Fault:
    return Fault(
        Severity(r.severity),
        Witness(r.witness),
        Kind(r.kind),
        r.subject,
        r.rule,
        r.why,
        r.part,
        r.evidence,
        as_utc(r.first_at),
        as_utc(r.last_at),
        r.table_version,
    )


def open_rows(s: Session, machine_id: str) -> list[HealthFault]:
    return list(
        s.exec(
            select(HealthFault)
            .where(HealthFault.machine_id == machine_id, col(HealthFault.cleared_at).is_(None))
            .order_by(col(HealthFault.first_at))
        )
    )


def health_of(s: Session, machine_id: str) -> Health:
    return Health({f.key: f for f in map(_fault, open_rows(s, machine_id))})


@dataclass(frozen=True)
class Recorded:
    health: Health
    new: list[Fault]
    cleared: list[Fault]


def record(
    s: Session,
    m: Machine,
    classified: Iterable[Classified],
    *,
    now: datetime,
    transient_ttl_s: float,
    actor: str,
    instance: str | None,
) -> Recorded:
    """Fold ``classified`` into the machine's open faults and write the difference (not
    committed). Transient faults older than the ttl are expired first."""
    rows: dict[FaultKey, HealthFault] = {
        (Witness(r.witness), Kind(r.kind), r.subject, r.rule): r for r in open_rows(s, m.id)
    }
    before = Health({f.key: f for f in map(_fault, rows.values())})
    aged = expire(before, now, timedelta(seconds=transient_ttl_s))
    items = list(classified)
    after = fold(aged, items)
    codes = {
        (c.signal.witness, c.signal.kind, c.signal.subject, c.rule): c.signal.code for c in items
    }
    new, cleared = [], []
    for key, f in after.faults.items():
        r = rows.get(key)
        if r is None:
            s.add(
                HealthFault(
                    machine_id=m.id,
                    open_key=open_key(m.id, key),
                    witness=f.witness,
                    kind=f.kind,
                    subject=f.subject[:200],
                    code=codes.get(key, "")[:300],
                    severity=f.severity,
                    rule=f.rule,
                    why=f.why,
                    part=f.part,
                    evidence=f.evidence,
                    table_version=f.table_version,
                    first_at=f.first_at,
                    last_at=f.last_at,
                )
            )
            new.append(f)
        elif (f.severity, f.last_at) != (Severity(r.severity), as_utc(r.last_at)):
            r.severity, r.last_at = f.severity, f.last_at
            r.count += 1
            s.add(r)
    for key, r in rows.items():
        if key not in after.faults:
            f = before.faults[key]
            r.cleared_at, r.open_key = now, None
            r.cleared_by = "expired" if key not in aged.faults else f.witness
            s.add(r)
            cleared.append(f)
    data_base = {"claim_id": m.claim_id} if m.claim_id else {}
    for f in new:
        machines.add_event(
            s,
            "health.fault",
            actor,
            machine_id=m.id,
            tenant_id=m.tenant_id,
            reason=f"{f.severity} ({f.rule}): {f.evidence}",
            data={
                **data_base,
                "severity": f.severity,
                "witness": f.witness,
                "kind": f.kind,
                "subject": f.subject,
                "rule": f.rule,
                "part": f.part,
                "table_version": f.table_version,
            },
            instance=instance,
        )
    for f in cleared:
        machines.add_event(
            s,
            "health.cleared",
            actor,
            machine_id=m.id,
            tenant_id=m.tenant_id,
            reason=f"{f.rule} on {f.subject} cleared",
            data={**data_base, "witness": f.witness, "kind": f.kind, "rule": f.rule},
            instance=instance,
        )
    return Recorded(after, new, cleared)


def close_all(s: Session, machine_id: str, *, by: str, now: datetime) -> int:
    """Close every open fault of a machine (after its repair)."""
    n = 0
    for r in open_rows(s, machine_id):
        r.cleared_at, r.open_key, r.cleared_by = now, None, by
        s.add(r)
        n += 1
    return n


def evidence(h: Health, limit: int = 400) -> str:
    """The worst faults' evidence in one line: what a drain reason and an event name."""
    parts = [f"{f.evidence}" for f in h.worst_faults()]
    text = "; ".join(dict.fromkeys(parts))
    return text if len(text) <= limit else text[: limit - 3] + "..."
