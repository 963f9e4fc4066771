"""A machine's health: classified signals folded into its faults, under the trust rule.

Witnesses in order of trust: the BMC, metald's own observation and the tenant's scheduler
(which metald runs), then the node agent. The rule:

- any witness can add a fault (a node can report itself sick);
- a fault is keyed by its witness, so a signal only ever touches faults of its own witness
  and a node's report never changes a BMC-, metald- or scheduler-witnessed fault;
- a clear (code ``ok``) removes the degraded and transient faults of the same kind and part
  that its own witness raised, and only when that witness is not the node: nothing the node
  says makes the machine look better, not even about its own earlier reports;
- a fatal fault is never cleared by a signal: it ends with a repair (``repaired``);
- transient faults are forgotten ``ttl`` after their last signal (``expire``), by the clock,
  never by a witness.

``fold`` is pure and never lowers the severity for a node signal (tests/health/test_trust.py
proves it with hypothesis).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from metald.health.classify import Classified, Severity, worst
from metald.health.signals import Kind, Witness

#: (witness, kind, subject, rule id)
FaultKey = tuple[Witness, Kind, str, str]


@dataclass(frozen=True)
class Fault:
    severity: Severity
    witness: Witness
    kind: Kind
    subject: str
    rule: str
    why: str
    part: str
    evidence: str
    first_at: datetime
    last_at: datetime
    table_version: str

    @property
    def key(self) -> FaultKey:
        return (self.witness, self.kind, self.subject, self.rule)


@dataclass(frozen=True)
class Health:
    faults: dict[FaultKey, Fault] = field(default_factory=dict)

    @property
    def severity(self) -> Severity:
        return worst(f.severity for f in self.faults.values())

    def worst_faults(self) -> list[Fault]:
        """The faults of the worst severity, oldest first (the evidence a step names)."""
        top = self.severity
        return sorted(
            (f for f in self.faults.values() if f.severity == top and top != Severity.OK),
            key=lambda f: (f.first_at, f.key),
        )


def _may_clear(clearer: Witness, fault: Fault) -> bool:
    return clearer != Witness.NODE and clearer == fault.witness and fault.severity != Severity.FATAL


def fold_one(h: Health, c: Classified) -> Health:
    s = c.signal
    faults = dict(h.faults)
    if c.severity == Severity.OK:
        if not s.is_clear:
            return h  # an observation no rule finds fault with: nothing to add, nothing cleared
        for k, f in h.faults.items():
            if f.kind == s.kind and f.subject == s.subject and _may_clear(s.witness, f):
                del faults[k]
        return Health(faults)
    new = Fault(c.severity, s.witness, s.kind, s.subject, c.rule, c.why, c.part, s.evidence,
                s.at, s.at, c.table_version)  # fmt: skip
    old = faults.get(new.key)
    if old is not None:
        new = replace(
            old,
            severity=worst((old.severity, new.severity)),
            last_at=max(old.last_at, s.at),
        )
    faults[new.key] = new
    return Health(faults)


def fold(h: Health, classified: Iterable[Classified]) -> Health:
    for c in classified:
        h = fold_one(h, c)
    return h


def expire(h: Health, now: datetime, ttl: timedelta) -> Health:
    """Transient faults whose last signal is older than ``ttl`` are forgotten."""
    return Health(
        {
            k: f
            for k, f in h.faults.items()
            if not (f.severity == Severity.TRANSIENT and now - f.last_at > ttl)
        }
    )


def repaired() -> Health:
    """After a technician's repair (and commissioning), a machine starts without faults."""
    return Health()
