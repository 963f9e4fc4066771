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
import re
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, or_
from sqlmodel import Session, col, select

from metald.auth import Principal, Role
from metald.store.models import (
    Bmc,
    CommissioningRun,
    Event,
    HealthFault,
    Image,
    Lease,
    Machine,
    Nic,
    Tenant,
    WgHub,
    WgPeer,
)
from metald.usecases import Transactions
from metald.usecases.machines import state_reasons
from metald.usecases.tenants import peer_view

#: Rows on one page of the fleet table.
PAGE_SIZE = 100
#: States a machine is held in for a reason someone gave: the WHY column shows it.
HELD_STATES = frozenset({"maintenance", "broken", "repairing", "retired"})
#: Filters the table offers (query parameters of /ui/).
FILTERS = ("q", "state", "gpu_model", "rack", "tenant", "label")
#: How the table is ordered and grouped (query parameters of /ui/ too: a view is a link).
VIEW = ("sort", "group")
#: Sortable columns: the SQL order (never NULL, so a keyset cursor compares) of each.
SORTS: dict[str, list[Any]] = {
    "name": [],
    "state": [col(Machine.state)],
    "rack": [
        func.coalesce(col(Machine.rack), ""),
        func.coalesce(col(Machine.rack_position), ""),
    ],
    "power": [func.coalesce(col(Machine.power_state), "")],
    "gpu": [col(Machine.gpu_count), func.coalesce(col(Machine.gpu_model), "")],
    "memory": [func.coalesce(col(Machine.memory_mb), 0)],
    "age": [col(Machine.state_changed_at)],
    "tenant": [func.coalesce(col(Machine.tenant_id), "")],
}
#: Groupings: the SQL key of each group (rows are ordered by it first).
GROUPS: dict[str, list[Any]] = {
    "state": [col(Machine.state)],
    "rack": [func.coalesce(col(Machine.rack), "")],
    "tenant": [func.coalesce(col(Machine.tenant_id), "")],
    "sku": [
        func.coalesce(col(Machine.product), ""),
        func.coalesce(col(Machine.gpu_model), ""),
        col(Machine.gpu_count),
    ],
}


@dataclass
class FleetQuery:
    q: str = ""
    state: str = ""
    gpu_model: str = ""
    rack: str = ""
    tenant: str = ""
    label: str = ""  # key=value
    sort: str = ""  # a SORTS key, "-" first for descending; name by default
    group: str = ""  # a GROUPS key
    after: str = ""  # the cursor

    @classmethod
    def from_params(cls, params: Any) -> FleetQuery:
        f = cls(**{k: str(params.get(k, "")).strip()[:200] for k in (*FILTERS, *VIEW, "after")})
        if f.sort.lstrip("-") not in SORTS:
            f.sort = ""
        if f.group not in GROUPS:
            f.group = ""
        return f

    def link(self, **change: str) -> str:
        values = {k: getattr(self, k) for k in (*FILTERS, *VIEW, "after")} | change
        from urllib.parse import urlencode

        return "/ui/?" + urlencode({k: v for k, v in values.items() if v})

    def sort_link(self, key: str) -> str:
        """The column header's link: sort by it, or flip its direction when sorted by it."""
        return self.link(sort=f"-{key}" if self.sort == key else key, after="")

    def sorted_as(self, key: str) -> str:
        """aria-sort of a column header."""
        if self.sort.lstrip("-") != key and not (key == "name" and not self.sort):
            return "none"
        return "descending" if self.sort.startswith("-") else "ascending"

    @property
    def filtered(self) -> bool:
        return any(getattr(self, k) for k in FILTERS)


@dataclass
class FleetRow:
    m: Machine
    bmc: Bmc | None = None
    tenant: str | None = None
    verdict: str | None = None
    #: Total disk bytes and how many disks (from the inventory), None when none known.
    disks: tuple[int, int] | None = None
    #: Why it is in its state (the reason given when it entered it: a maintenance reason).
    reason: str | None = None

    @property
    def why(self) -> str:
        """What the WHY column shows: the last error, else the reason of a held or failed
        state (``metalctl machines list`` shows the same)."""
        held = self.m.state in HELD_STATES or self.m.state.endswith("-failed")
        return self.m.last_error or (self.reason if held else None) or ""

    @property
    def key(self) -> str:
        return self.m.name or self.m.id

    def values(self, f: FleetQuery) -> list[Any]:
        """This row's values of the page's order (``order``), for the keyset cursor."""
        m = self.m
        by: dict[str, list[Any]] = {
            "state": [m.state],
            "rack": [m.rack or "", m.rack_position or ""],
            "power": [m.power_state or ""],
            "gpu": [m.gpu_count, m.gpu_model or ""],
            "memory": [m.memory_mb or 0],
            "age": [m.state_changed_at.isoformat() if m.state_changed_at else ""],
            "tenant": [m.tenant_id or ""],
        }
        groups: dict[str, list[Any]] = {
            "state": [m.state],
            "rack": [m.rack or ""],
            "tenant": [m.tenant_id or ""],
            "sku": [m.product or "", m.gpu_model or "", m.gpu_count],
        }
        return [
            *(groups[f.group] if f.group else []),
            *by.get(f.sort.lstrip("-"), []),
            self.key,
            m.id,
        ]

    def group_of(self, f: FleetQuery) -> tuple[Any, ...]:
        return tuple(self.values(f)[: len(GROUPS[f.group])]) if f.group else ()


@dataclass
class FleetPage:
    rows: list[FleetRow]
    counts: dict[str, int]
    total: int
    next: str | None
    #: With a grouping: each group's key (as ``FleetRow.group_of``) -> its machines matching.
    groups: dict[tuple[Any, ...], int] = field(default_factory=dict)
    gpu_models: list[str] = field(default_factory=list)
    racks: list[str] = field(default_factory=list)
    tenants: list[tuple[str, str]] = field(default_factory=list)


def _cursor(values: list[Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(values).encode()).decode()


def _uncursor(cursor: str, n: int) -> list[Any] | None:
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor.encode()))
    except (ValueError, TypeError):
        return None
    if not isinstance(values, list) or len(values) != n:
        return None
    for v in values:
        if not isinstance(v, (str, int)) or isinstance(v, bool):
            return None
        if isinstance(v, str) and "\x00" in v:
            return None  # not a cursor this page issued (NUL: PostgreSQL text cannot hold it)
    return values


def order(f: FleetQuery) -> list[tuple[Any, bool]]:
    """The page's order: the group's key, the sorted column (descending with "-"), then
    name and id (unique: a keyset cursor never skips or repeats a row)."""
    desc = f.sort.startswith("-")
    return [
        *((e, False) for e in (GROUPS[f.group] if f.group else [])),
        *((e, desc) for e in SORTS.get(f.sort.lstrip("-"), [])),
        (_KEY, False),
        (col(Machine.id), False),
    ]


def _after(ordering: list[tuple[Any, bool]], values: list[Any]) -> Any:
    """Rows after the cursor's row in this order (a lexicographic keyset comparison)."""
    vals = [_value(e, v) for (e, _), v in zip(ordering, values, strict=True)]
    terms = []
    for i, (expr, desc) in enumerate(ordering):
        same = [ordering[j][0] == vals[j] for j in range(i)]
        terms.append(and_(*same, expr < vals[i] if desc else expr > vals[i]))
    return or_(*terms)


def _value(expr: Any, v: Any) -> Any:
    if expr is SORTS["age"][0]:
        return datetime.fromisoformat(v) if v else None
    return v


_KEY = func.coalesce(col(Machine.name), col(Machine.id))


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


def fleet_page(s: Session, p: Principal, f: FleetQuery, limit: int = PAGE_SIZE) -> FleetPage:
    clauses = where(p, f)
    stmt = select(Machine).where(*clauses)
    ordering = order(f)
    after = _uncursor(f.after, len(ordering)) if f.after else None
    if after is not None:
        stmt = stmt.where(_after(ordering, after))
    by = [e.desc() if desc else e for e, desc in ordering]
    machines = list(s.exec(stmt.order_by(*by).limit(limit + 1)))
    more = len(machines) > limit
    machines = machines[:limit]
    rows = decorate(s, machines)
    visible = scope(p)
    counts = dict(
        s.exec(select(Machine.state, func.count()).where(*visible).group_by(Machine.state)).all()  # type: ignore[arg-type]
    )
    total = s.exec(select(func.count()).select_from(Machine).where(*clauses)).one()
    groups: dict[tuple[Any, ...], int] = {}
    if f.group:
        keys = GROUPS[f.group]
        for *key, n in s.exec(select(*keys, func.count()).where(*clauses).group_by(*keys)).all():  # type: ignore[call-overload]
            groups[tuple(key)] = n
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
        next=_cursor(last.values(f)) if more and last else None,
        groups=groups,
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
    held = [m for m in machines if m.state in HELD_STATES or m.state.endswith("-failed")]
    reasons = state_reasons(s, held) if held else {}
    return [
        FleetRow(
            m,
            bmcs.get(m.id),
            tenants.get(m.tenant_id or ""),
            verdicts.get(m.id),
            disks.get(m.id),
            reasons.get(m.id),
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


#: Health fault kinds about GPUs (``metald.health.signals.Kind``): the rack view's GPU colour.
GPU_FAULT_KINDS = (
    "xid",
    "gpu-ecc",
    "gpu-pages",
    "gpu-throttle",
    "gpu-count",
    "nvlink",
    "dcgm-health",
)
#: Racks on one page of the rack view.
RACKS_PER_PAGE = 24
#: Racks drawn at least this many units high.
RACK_UNITS = 42
_UNIT = re.compile(r"^[uU]?(\d{1,3})$")


@dataclass
class RackSlot:
    id: str
    name: str
    state: str
    power: str  # on, off, unknown
    gpu: str  # ok, degraded, fatal, none (no GPUs)
    position: str | None


@dataclass
class Rack:
    name: str
    units: int
    #: unit number -> the machine there (1 at the bottom)
    slots: dict[int, RackSlot]
    #: machines of the rack whose position is no unit number (a switch port, or none)
    unplaced: list[RackSlot]

    def top_down(self) -> list[tuple[int, RackSlot | None]]:
        return [(u, self.slots.get(u)) for u in range(self.units, 0, -1)]


def unit_of(position: str | None) -> int | None:
    """The rack unit a position names (``u12``, ``12``), or None (``sw1/eth12``)."""
    m = _UNIT.match((position or "").strip())
    return int(m.group(1)) if m and 0 < int(m.group(1)) <= 100 else None


@dataclass
class RackPage:
    racks: list[Rack]
    #: Racks the filters list, in all.
    total: int
    #: The first rack of the next page, if there is one.
    next: str | None


def racks(s: Session, p: Principal, f: FleetQuery, start: str = "") -> RackPage:
    """The racks of the machines the fleet's filters list, ``RACKS_PER_PAGE`` of them from
    ``start`` on (by name), each machine in its unit with its state, power and GPU health
    (four statements, whatever the fleet's size)."""
    clauses = [*where(p, f), col(Machine.rack).is_not(None)]
    names = sorted(x for x in s.exec(select(Machine.rack).where(*clauses).distinct()).all() if x)
    shown = [n for n in names if n >= start][: RACKS_PER_PAGE + 1]
    more = shown[RACKS_PER_PAGE] if len(shown) > RACKS_PER_PAGE else None
    shown = shown[:RACKS_PER_PAGE]
    if not shown:
        return RackPage([], len(names), None)
    clauses.append(col(Machine.rack).in_(shown))
    rows = s.exec(
        select(
            Machine.id,
            Machine.name,
            Machine.rack,
            Machine.rack_position,
            Machine.state,
            Machine.power_state,
            Machine.gpu_count,
        ).where(*clauses)
    ).all()
    ids = [r[0] for r in rows]
    power = (
        dict(
            s.exec(
                select(Bmc.machine_id, Bmc.power_state).where(col(Bmc.machine_id).in_(ids))
            ).all()  # type: ignore[arg-type]
        )
        if ids
        else {}
    )
    worst: dict[str, str] = {}
    if ids:
        faults = s.exec(
            select(HealthFault.machine_id, HealthFault.severity).where(
                col(HealthFault.machine_id).in_(ids),
                col(HealthFault.cleared_at).is_(None),
                col(HealthFault.kind).in_(GPU_FAULT_KINDS),
            )
        ).all()
        for mid, severity in faults:
            if worst.get(mid) != "fatal":
                worst[mid] = "fatal" if severity == "fatal" else "degraded"
    out: dict[str, Rack] = {}
    for mid, name, rack, position, state, m_power, gpus in rows:
        slot = RackSlot(
            mid,
            name or mid[:8],
            state,
            (power.get(mid) or m_power or "unknown").lower(),
            worst.get(mid, "ok") if gpus else "none",
            position,
        )
        r = out.setdefault(rack, Rack(rack, RACK_UNITS, {}, []))
        unit = unit_of(position)
        if unit is None or unit in r.slots:
            r.unplaced.append(slot)
        else:
            r.slots[unit] = slot
            r.units = max(r.units, unit)
    for r in out.values():
        r.unplaced.sort(key=lambda x: x.name)
    return RackPage([out[k] for k in sorted(out)], len(names), more)


def latest_events(s: Session, p: Principal, machine_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Each machine's newest event (kind, reason, at), those the caller may see: what a claim's
    machine waits on (``provision.no-bmc``, a failure), in one statement."""
    if not machine_ids:
        return {}
    visible = select(Machine.id).where(col(Machine.id).in_(machine_ids[:500]), *scope(p))
    newest = (
        select(func.max(Event.id))
        .where(col(Event.machine_id).in_(visible))
        .group_by(col(Event.machine_id))
    )
    rows = s.exec(select(Event).where(col(Event.id).in_(newest)))
    return {
        e.machine_id: {"kind": e.kind, "reason": e.reason, "at": e.at} for e in rows if e.machine_id
    }


def ref_names(s: Session, tenant_ids: list[str], image_ids: list[str]) -> dict[str, str]:
    """Tenants' and images' names by id (a page shows names, not ids)."""
    out: dict[str, str] = {}
    if tenant_ids:
        out.update(
            s.exec(select(Tenant.id, Tenant.name).where(col(Tenant.id).in_(tenant_ids))).all()
        )  # type: ignore[arg-type]
    if image_ids:
        out.update(s.exec(select(Image.id, Image.name).where(col(Image.id).in_(image_ids))).all())  # type: ignore[arg-type]
    return out


def names_of(s: Session, p: Principal, ids: list[str]) -> dict[str, str]:
    """These machines' names, those the caller may see (id -> name)."""
    # A NUL cannot be in an id (PostgreSQL text cannot even hold it): such an entry names no
    # machine, and asking the database for it would fail the whole read.
    ids = [i for i in ids[:500] if "\x00" not in i]
    if not ids:
        return {}
    stmt = select(Machine.id, Machine.name).where(col(Machine.id).in_(ids), *scope(p))
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

    async def racks(self, p: Principal, f: FleetQuery, start: str = "") -> RackPage:
        return await self.store.read(racks, p, f, start)

    async def latest_events(self, p: Principal, ids: list[str]) -> dict[str, dict[str, Any]]:
        return await self.store.read(latest_events, p, ids)

    async def ref_names(self, tenant_ids: list[str], image_ids: list[str]) -> dict[str, str]:
        return await self.store.read(ref_names, tenant_ids, image_ids)

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
