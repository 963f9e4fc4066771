"""The web console's own reads (``api.ui``): the fleet table, the tenants page's hubs, peers
and nodes, the newest event's id, a machine's BMC. Everything else the console shows comes
from the API's routes, called in process.

The fleet table: one page of machines visible to the caller, filtered and searched, in name
order with a keyset cursor, plus the counts by state (the benchmark, ``bench/ui_fleet.py``,
times ``fleet_page`` with the page around it). One statement selects the page's machines (the
filters, search and scope are WHERE clauses on indexed columns or ``IN`` subqueries); the
BMCs, tenants and last commissioning verdicts of those rows are then read in one statement
each, so a page costs the same with 50 machines or 50,000.

The tenants page: hubs, peers and nodes for all listed tenants at once, three statements
whatever the number of tenants. The tenants themselves come from the API's own list route
(scoped to the caller); the nodes are filtered again by the fleet's scope rule (``scope``), and
a hub is shown with the fields ``GET /api/v1/tenants/{id}/hub`` shows (never its private key)."""

from __future__ import annotations

import base64
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, func, or_
from sqlmodel import Session, col, select

from metald.auth import Principal, Role
from metald.store.models import (
    Bmc,
    CommissioningRun,
    Event,
    Lease,
    Machine,
    Nic,
    Tenant,
    WgHub,
    WgPeer,
)
from metald.usecases import Transactions
from metald.usecases.tenants import peer_view

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
    #: Total disk bytes and how many disks (from the inventory), None when none known.
    disks: tuple[int, int] | None = None

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
    disks = _disks(s, ids)
    return [
        FleetRow(
            m, bmcs.get(m.id), tenants.get(m.tenant_id or ""), verdicts.get(m.id), disks.get(m.id)
        )
        for m in machines
    ]


def _disks(s: Session, ids: list[str]) -> dict[str, tuple[int, int]]:
    """Each machine's disks from its inventory: total bytes and count (one statement; the
    inventory's disk list only, not the whole document)."""
    path = col(Machine.inventory)["normalized"]["disks"]
    out: dict[str, tuple[int, int]] = {}
    for mid, disks in s.exec(select(Machine.id, path).where(col(Machine.id).in_(ids))).all():
        if isinstance(disks, list) and disks:
            sizes = [d.get("size_bytes") or 0 for d in disks if isinstance(d, dict)]
            out[mid] = (int(sum(sizes)), len(sizes))
    return out


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


@dataclass
class TenantDetails:
    #: tenant id -> the hub (ifname, endpoint, address, public_key, listen_port, peers)
    hubs: dict[str, dict[str, Any]]
    #: tenant id -> its machines the caller may see, in name order
    nodes: dict[str, list[dict[str, Any]]]


def tenant_details(s: Session, p: Principal, tenant_ids: list[str]) -> TenantDetails:
    if not tenant_ids:
        return TenantDetails({}, {})
    hubs: dict[str, dict[str, Any]] = {}
    for h in s.exec(select(WgHub).where(col(WgHub.tenant_id).in_(tenant_ids))):
        hubs[h.tenant_id] = {
            "ifname": h.ifname,
            "public_key": h.public_key,
            "endpoint": h.endpoint,
            "listen_port": h.listen_port,
            "address": h.address,
            "peers": [],
        }
    peers = s.exec(
        select(WgPeer)
        .where(col(WgPeer.tenant_id).in_(list(hubs)))
        .order_by(col(WgPeer.tenant_id), col(WgPeer.address))
    )
    for peer in peers if hubs else ():
        hubs[peer.tenant_id]["peers"].append(peer_view(peer))
    nodes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    machines = s.exec(
        select(Machine.id, Machine.name, Machine.state, Machine.tenant_id)
        .where(col(Machine.tenant_id).in_(tenant_ids), *scope(p))
        .order_by(col(Machine.name), col(Machine.id))
    )
    for mid, name, state, tenant_id in machines:
        nodes[tenant_id].append({"id": mid, "name": name, "state": state})
    return TenantDetails(hubs, dict(nodes))


def last_event_id(s: Session) -> int:
    """The newest event's id (0: none yet): where a live page's event stream starts."""
    return s.exec(select(func.max(Event.id))).one() or 0


def counts(s: Session, p: Principal) -> dict[str, int]:
    """How many machines the caller may see are in each state."""
    return dict(
        s.exec(
            select(Machine.state, func.count()).where(*scope(p)).group_by(Machine.state)  # type: ignore[arg-type]
        ).all()
    )


#: What a machine page shows of its BMC (staff only).
BMC_FIELDS = {
    "id",
    "address",
    "port",
    "protocol",
    "health",
    "health_detail",
    "power_state",
    "last_seen_at",
}


def bmc_of(s: Session, machine_id: str) -> dict[str, Any] | None:
    b = s.exec(select(Bmc).where(col(Bmc.machine_id) == machine_id)).first()
    return None if b is None else b.model_dump(include=BMC_FIELDS)


def names_of(s: Session, p: Principal, ids: list[str]) -> dict[str, str]:
    """These machines' names, those the caller may see (id -> name)."""
    if not ids:
        return {}
    stmt = select(Machine.id, Machine.name).where(col(Machine.id).in_(ids[:500]), *scope(p))
    return {i: n for i, n in s.exec(stmt).all() if n}


@dataclass
class Console:
    """The console's reads, each in a read-only transaction of its own."""

    store: Transactions

    async def fleet_page(self, p: Principal, f: FleetQuery) -> FleetPage:
        return await self.store.read(fleet_page, p, f)

    async def rows_by_id(self, p: Principal, ids: list[str]) -> list[FleetRow]:
        return await self.store.read(rows_by_id, p, ids)

    async def rows_matching(self, p: Principal, f: FleetQuery, ids: list[str]) -> list[FleetRow]:
        return await self.store.read(rows_matching, p, f, ids)

    async def counts(self, p: Principal) -> dict[str, int]:
        return await self.store.read(counts, p)

    async def names_of(self, p: Principal, ids: list[str]) -> dict[str, str]:
        return await self.store.read(names_of, p, ids)

    async def last_event_id(self) -> int:
        return await self.store.read(last_event_id)

    async def bmc_of(self, machine_id: str) -> dict[str, Any] | None:
        return await self.store.read(bmc_of, machine_id)

    async def tenant_details(self, p: Principal, tenant_ids: list[str]) -> TenantDetails:
        return await self.store.read(tenant_details, p, tenant_ids)


__all__ = [
    "Console",
    "FleetPage",
    "FleetQuery",
    "FleetRow",
    "TenantDetails",
    "fleet_page",
    "rows_by_id",
    "rows_matching",
    "tenant_details",
]
