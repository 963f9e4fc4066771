"""The fleet table's query: one page of machines visible to the caller, filtered and searched,
in name order with a keyset cursor, plus the counts by state. A pure function over a store
``Session`` (the benchmark, ``bench/ui_fleet.py``, times it with the page around it).

One statement selects the page's machines (the filters, search and scope are WHERE clauses on
indexed columns or ``IN`` subqueries); the BMCs, tenants and last commissioning verdicts of
those rows are then read in one statement each, so a page costs the same with 50 machines or
50,000."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, func, or_
from sqlmodel import Session, col, select

from metald.auth import Principal, Role
from metald.store.models import Bmc, CommissioningRun, Lease, Machine, Nic, Tenant

#: Rows on one page of the fleet table.
PAGE_SIZE = 100
#: Filters the table offers (query parameters of /ui/).
FILTERS = ("q", "state", "gpu_model", "rack", "tenant", "label")


@dataclass
class FleetQuery:
    q: str = ""
    state: str = ""
    gpu_model: str = ""
    rack: str = ""
    tenant: str = ""
    label: str = ""  # key=value
    after: str = ""  # the cursor

    @classmethod
    def from_params(cls, params: Any) -> FleetQuery:
        return cls(**{k: str(params.get(k, "")).strip()[:200] for k in (*FILTERS, "after")})

    def link(self, **change: str) -> str:
        values = {k: getattr(self, k) for k in (*FILTERS, "after")} | change
        from urllib.parse import urlencode

        return "/ui/?" + urlencode({k: v for k, v in values.items() if v})


@dataclass
class FleetRow:
    m: Machine
    bmc: Bmc | None = None
    tenant: str | None = None
    verdict: str | None = None

    @property
    def key(self) -> str:
        return self.m.name or self.m.id


@dataclass
class FleetPage:
    rows: list[FleetRow]
    counts: dict[str, int]
    total: int
    next: str | None
    gpu_models: list[str] = field(default_factory=list)
    racks: list[str] = field(default_factory=list)
    tenants: list[tuple[str, str]] = field(default_factory=list)


def _cursor(key: str, mid: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([key, mid]).encode()).decode()


def _uncursor(cursor: str) -> tuple[str, str] | None:
    try:
        key, mid = json.loads(base64.urlsafe_b64decode(cursor.encode()))
    except (ValueError, TypeError):
        return None
    if not isinstance(key, str) or not isinstance(mid, str) or "\x00" in key + mid:
        return None  # not a cursor this page issued (NUL: PostgreSQL text cannot hold it)
    return key, mid


def scope(p: Principal) -> list[Any]:
    """What the caller may see of the fleet: staff all of it; an orchestrator its tenants'
    machines (``Principal.can_see_machine``'s rule, as a WHERE clause)."""
    if p.role in (Role.ADMIN, Role.TECHNICIAN):
        return []
    if p.role is Role.ORCHESTRATOR:
        return [col(Machine.tenant_id).in_(sorted(p.scope))]
    return [col(Machine.id).in_(sorted(p.scope))]


def _search(q: str) -> Any:
    """Name, serial, MAC (its NICs), IP (its NICs' DHCP leases) or BMC address."""
    like = f"%{q.lower()}%"
    mac = q.lower().replace("-", ":")
    return or_(
        func.lower(col(Machine.name)).like(like),
        func.lower(col(Machine.serial)).like(like),
        col(Machine.id).in_(select(Nic.machine_id).where(col(Nic.mac).like(f"%{mac}%"))),
        col(Machine.id).in_(
            select(Nic.machine_id).where(
                col(Nic.mac).in_(select(Lease.mac).where(col(Lease.ip) == q))
            )
        ),
        col(Machine.id).in_(select(Bmc.machine_id).where(func.lower(col(Bmc.address)).like(like))),
    )


def where(p: Principal, f: FleetQuery) -> list[Any]:
    clauses = scope(p)
    if f.state:
        clauses.append(col(Machine.state) == f.state)
    if f.gpu_model:
        clauses.append(col(Machine.gpu_model) == f.gpu_model)
    if f.rack:
        clauses.append(col(Machine.rack) == f.rack)
    if f.tenant:
        clauses.append(col(Machine.tenant_id) == f.tenant)
    if f.label:
        key, _, value = f.label.partition("=")
        clauses.append(Machine.labels[key.strip()].as_string() == value.strip())  # type: ignore[index]
    if f.q:
        clauses.append(_search(f.q))
    return clauses


_KEY = func.coalesce(col(Machine.name), col(Machine.id))


def fleet_page(s: Session, p: Principal, f: FleetQuery, limit: int = PAGE_SIZE) -> FleetPage:
    clauses = where(p, f)
    stmt = select(Machine).where(*clauses)
    after = _uncursor(f.after) if f.after else None
    if after is not None:
        stmt = stmt.where(or_(after[0] < _KEY, and_(after[0] == _KEY, col(Machine.id) > after[1])))
    machines = list(s.exec(stmt.order_by(_KEY, col(Machine.id)).limit(limit + 1)))
    more = len(machines) > limit
    machines = machines[:limit]
    rows = decorate(s, machines)
    visible = scope(p)
    counts = dict(
        s.exec(select(Machine.state, func.count()).where(*visible).group_by(Machine.state)).all()  # type: ignore[arg-type]
    )
    total = s.exec(select(func.count()).select_from(Machine).where(*clauses)).one()
    gpu_models = sorted(
        x for x in s.exec(select(Machine.gpu_model).where(*visible).distinct()).all() if x
    )
    racks = sorted(x for x in s.exec(select(Machine.rack).where(*visible).distinct()).all() if x)
    tq = select(Tenant.id, Tenant.name).order_by(Tenant.name)
    if p.role is Role.ORCHESTRATOR:
        tq = tq.where(col(Tenant.id).in_(sorted(p.scope)))
    tenants = [(i, n) for i, n in s.exec(tq).all()]
    last = rows[-1] if rows else None
    return FleetPage(
        rows=rows,
        counts=counts,
        total=total,
        next=_cursor(last.key, last.m.id) if more and last else None,
        gpu_models=gpu_models,
        racks=racks,
        tenants=tenants,
    )


def decorate(s: Session, machines: list[Machine]) -> list[FleetRow]:
    """The table's other columns for these machines: BMC, tenant name, last verdict."""
    ids = [m.id for m in machines]
    if not ids:
        return []
    bmcs = {b.machine_id: b for b in s.exec(select(Bmc).where(col(Bmc.machine_id).in_(ids)))}
    tenant_ids = sorted({m.tenant_id for m in machines if m.tenant_id})
    tenants = (
        dict(
            s.exec(select(Tenant.id, Tenant.name).where(col(Tenant.id).in_(tenant_ids))).all()  # type: ignore[arg-type]
        )
        if tenant_ids
        else {}
    )
    latest = (
        select(CommissioningRun.machine_id, func.max(CommissioningRun.created_at).label("at"))
        .where(col(CommissioningRun.machine_id).in_(ids))
        .group_by(CommissioningRun.machine_id)
        .subquery()
    )
    verdicts = dict(
        s.exec(
            select(CommissioningRun.machine_id, CommissioningRun.status).join(
                latest,
                and_(
                    col(CommissioningRun.machine_id) == latest.c.machine_id,
                    col(CommissioningRun.created_at) == latest.c.at,
                ),
            )
        ).all()  # type: ignore[arg-type]
    )
    return [
        FleetRow(m, bmcs.get(m.id), tenants.get(m.tenant_id or ""), verdicts.get(m.id))
        for m in machines
    ]


def rows_by_id(s: Session, p: Principal, ids: list[str]) -> list[FleetRow]:
    """These machines' rows, those the caller may see (the live table refreshes them)."""
    if not ids:
        return []
    stmt = select(Machine).where(col(Machine.id).in_(ids[:200]), *scope(p))
    return decorate(s, list(s.exec(stmt)))


def rows_matching(s: Session, p: Principal, f: FleetQuery, ids: list[str]) -> list[FleetRow]:
    """Of these machines, those the fleet page's query would list: the caller's scope, the
    page's filters and search (the live table adds them; never a row from an event's payload,
    so a new machine outside the caller's scope or filters is never shown)."""
    if not ids:
        return []
    stmt = select(Machine).where(col(Machine.id).in_(ids[:200]), *where(p, f))
    return decorate(s, list(s.exec(stmt)))


__all__ = ["FleetPage", "FleetQuery", "FleetRow", "fleet_page", "rows_by_id", "rows_matching"]
