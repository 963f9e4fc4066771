"""What the claim flows share: a claim's machines, their latest progress, the switch plan
recorded with claim events, and the retry of a whole transaction that lost a race."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.exc import OperationalError
from sqlmodel import Session, col, select

from metald import machines
from metald.errors import Conflict
from metald.store.db import store_unavailable
from metald.store.models import Event, Machine, Nic, Tenant, as_utc
from metald.tenants import fabric

T = TypeVar("T")

#: Whole-transaction retries after losing a race (a CAS miss or a PostgreSQL deadlock abort).
ATTEMPTS = 4


def retrying(session: Session, fn: Callable[[], T]) -> T:
    """Run ``fn`` (one whole transaction) again after losing a race to another writer."""
    for attempt in range(ATTEMPTS):
        try:
            return fn()
        except (machines.ConcurrentUpdate, OperationalError) as e:
            if store_unavailable(e):
                raise  # not a race: the database is unreachable (the API answers 503)
            # A CAS miss already rolled back; a PostgreSQL deadlock/serialisation abort has not.
            session.rollback()
            if attempt == ATTEMPTS - 1:
                raise Conflict(
                    "other writers kept changing these machines; retry the request"
                ) from None
    raise AssertionError("unreachable")


def claim_machines(session: Session, claim_id: str) -> list[Machine]:
    return list(
        session.exec(
            select(Machine).where(Machine.claim_id == claim_id).order_by(col(Machine.id))
        ).all()
    )


def switch_plan(session: Session, tenant_id: str, ms: list[Machine]) -> dict[str, Any]:
    """What switch automation needs to put these machines on (or take them off) the tenant's
    VLAN: the VLAN id, and each machine's switch port (DHCP option 82) and NIC MACs. metald
    does not configure switches; separating tenants on the underlay is the switches' job."""
    tenant = session.get(Tenant, tenant_id)
    ids = [m.id for m in ms]
    macs: dict[str, list[str]] = {i: [] for i in ids}
    if ids:
        for nic in session.exec(
            select(Nic).where(col(Nic.machine_id).in_(ids)).order_by(col(Nic.mac))
        ):
            macs[nic.machine_id].append(nic.mac)
    return {
        "vlan": tenant.vlan if tenant else None,
        # InfiniBand: the subnet manager puts these port GUIDs in (or out of) this partition.
        "pkey": tenant.pkey if tenant else None,
        "ports": [
            {
                "machine_id": m.id,
                "switch_port": m.rack_position,
                "macs": macs[m.id],
                "port_guids": fabric.port_guids(m.inventory),
            }
            for m in ms
        ],
    }


def latest_progress(session: Session, ms: list[Machine]) -> dict[str, dict[str, Any]]:
    """The newest ``provision.progress`` data per machine, since it entered its state."""
    out: dict[str, dict[str, Any]] = {}
    if not ms:
        return out
    since = {m.id: m.state_changed_at for m in ms}
    rows = session.exec(
        select(Event)
        .where(Event.kind == "provision.progress", col(Event.machine_id).in_(list(since)))
        .order_by(col(Event.id).desc())
        .limit(50 * len(ms))
    ).all()
    for ev in rows:
        mid = ev.machine_id or ""
        if mid in out or as_utc(ev.at) < as_utc(since[mid]):
            continue
        out[mid] = {**(ev.data or {}), "at": ev.at}
    return out
