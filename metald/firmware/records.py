"""Baselines in the store: versioned per profile, and each machine's profile and findings."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func
from sqlmodel import Session, select

from metald.firmware.baselines import BaselineSpec, Component, Finding, compare
from metald.inventory.normalize import NormalizedInventory
from metald.inventory.rules import EnrollmentRule, profile_for
from metald.machines import add_event
from metald.store.models import FirmwareBaseline, Machine


def baseline_view(b: FirmwareBaseline) -> dict[str, Any]:
    return b.model_dump()


def add_baseline(
    s: Session,
    profile: str,
    spec: BaselineSpec,
    *,
    note: str | None,
    actor: str,
    instance: str,
) -> FirmwareBaseline:
    """Store ``spec`` as the profile's next version (the first is 1) with an event. Two
    writers racing for one version: the unique (profile, version) refuses the second."""
    top = s.exec(
        select(func.max(FirmwareBaseline.version)).where(FirmwareBaseline.profile == profile)
    ).one()
    row = FirmwareBaseline(
        profile=profile,
        version=int(top or 0) + 1,
        components=[c.model_dump() for c in spec.components],
        note=note,
        created_by=actor,
    )
    s.add(row)
    add_event(
        s,
        "firmware.baseline",
        actor,
        instance=instance,
        reason=f"firmware baseline of profile {profile} is now version {row.version}",
        data={"profile": profile, "version": row.version, "components": row.components},
    )
    s.commit()
    s.refresh(row)
    return row


def latest(s: Session, profile: str | None = None) -> dict[str, FirmwareBaseline]:
    """The newest version of each profile's baseline (of one profile, when named)."""
    newest = select(
        FirmwareBaseline.profile, func.max(FirmwareBaseline.version).label("v")
    ).group_by(FirmwareBaseline.profile)
    if profile is not None:
        newest = newest.where(FirmwareBaseline.profile == profile)
    sub = newest.subquery()
    rows = s.exec(
        select(FirmwareBaseline).join(
            sub,
            (FirmwareBaseline.profile == sub.c.profile)  # type: ignore[arg-type]
            & (FirmwareBaseline.version == sub.c.v),
        )
    ).all()
    return {r.profile: r for r in rows}


def history(s: Session, profile: str) -> list[FirmwareBaseline]:
    return list(
        s.exec(
            select(FirmwareBaseline)
            .where(FirmwareBaseline.profile == profile)
            .order_by(FirmwareBaseline.version.desc())  # type: ignore[attr-defined]
        ).all()
    )


def components_of(b: FirmwareBaseline) -> list[Component]:
    return [Component.model_validate(c) for c in b.components]


def machine_profile(rules: list[EnrollmentRule], m: Machine) -> str | None:
    """The SKU profile the enroll rules give the machine's last inventory (None: none)."""
    inv = (m.inventory or {}).get("normalized")
    if inv is None:
        return None
    found = profile_for(rules, NormalizedInventory.model_validate(inv), m.rack_position)
    return found.name if found is not None else None


@dataclass(frozen=True)
class Compliance:
    machine: Machine
    profile: str
    baseline: FirmwareBaseline
    findings: list[Finding]

    @property
    def compliant(self) -> bool:
        return all(f.status == "ok" for f in self.findings)

    def view(self) -> dict[str, Any]:
        m = self.machine
        return {
            "machine_id": m.id,
            "name": m.name,
            "state": m.state,
            "rack": m.rack,
            "profile": self.profile,
            "baseline_version": self.baseline.version,
            "compliant": self.compliant,
            "off_baseline": [f.as_dict() for f in self.findings if f.status != "ok"],
            "components": [f.as_dict() for f in self.findings],
        }


def compliance_of(
    rules: list[EnrollmentRule],
    machines: Iterable[Machine],
    baselines: dict[str, FirmwareBaseline],
) -> list[Compliance]:
    """Each machine whose profile has a baseline, against it (others are not listed)."""
    out: list[Compliance] = []
    parsed = {p: components_of(b) for p, b in baselines.items()}
    for m in machines:
        profile = machine_profile(rules, m)
        if profile is None or profile not in baselines:
            continue
        out.append(
            Compliance(
                m, profile, baselines[profile], compare(parsed[profile], m.firmware_versions)
            )
        )
    return out
