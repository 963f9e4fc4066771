"""Refresh metald's store gauges at scrape time: one short read transaction, one query each.

The gauges (defined in metald.metrics) describe what the shared database holds, so every
instance reports the same values; nothing is kept up to date between scrapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from ipaddress import IPv4Address

from sqlalchemy import func
from sqlmodel import Session, select

from metald import metrics
from metald.boot import metrics as boot_metrics
from metald.config import DhcpNetwork
from metald.lifecycle import State
from metald.store.models import Bmc, Claim, Event, Instance, Lease, Machine, Tenant, WgPeer, as_utc

#: /metrics shows the boot plane's counters (at zero) even where no boot server runs in this
#: process: dashboards and rules then read a series that exists, never a missing one.
BOOT_COUNTERS = boot_metrics.dhcp_packets


@dataclass
class Snapshot:
    machines: dict[str, int] = field(default_factory=dict)
    pool_used: dict[str, int] = field(default_factory=dict)
    claims: dict[str, int] = field(default_factory=dict)
    bmcs: dict[str, int] = field(default_factory=dict)
    hub_peers: dict[str, int] = field(default_factory=dict)
    hub_silent: dict[str, int] = field(default_factory=dict)
    hub_age: dict[str, float] = field(default_factory=dict)
    event_rows: int = 0
    heartbeat_age: dict[str, float] = field(default_factory=dict)


def _pool_bounds(networks: list[DhcpNetwork]) -> dict[str, tuple[int, int]]:
    return {n.name: (int(n.pool_start), int(n.pool_end)) for n in networks}


def snapshot(s: Session, networks: list[DhcpNetwork]) -> Snapshot:
    """Read every store gauge's value. ``now`` is the database's clock, as heartbeats are."""
    snap = Snapshot()
    now = as_utc(s.exec(select(func.now())).one())  # type: ignore[call-overload]
    snap.machines = dict(
        s.exec(select(Machine.state, func.count()).group_by(Machine.state)).all()  # type: ignore[arg-type]
    )
    bounds = _pool_bounds(networks)
    used = {name: 0 for name in bounds}
    rows = s.exec(
        select(Lease.network, Lease.ip).where(
            Lease.state.in_(("offered", "bound")),  # type: ignore[attr-defined]
            Lease.expires_at > now,  # type: ignore[arg-type]
        )
    ).all()
    for network, ip in rows:
        lo_hi = bounds.get(network)
        if lo_hi is not None and lo_hi[0] <= int(IPv4Address(ip)) <= lo_hi[1]:
            used[network] += 1
    snap.pool_used = used
    snap.claims = dict(s.exec(select(Claim.state, func.count()).group_by(Claim.state)).all())  # type: ignore[arg-type]
    snap.bmcs = dict(s.exec(select(Bmc.health, func.count()).group_by(Bmc.health)).all())  # type: ignore[arg-type]
    hubs = s.exec(
        select(
            Tenant.name,
            func.count(WgPeer.id),  # type: ignore[arg-type]
            func.count(WgPeer.last_handshake_at),  # type: ignore[arg-type]
            func.min(WgPeer.last_handshake_at),
        )
        .join(Tenant, Tenant.id == WgPeer.tenant_id)  # type: ignore[arg-type]
        .group_by(Tenant.name)
    ).all()
    for tenant, peers, shook, oldest in hubs:
        snap.hub_peers[tenant] = peers
        snap.hub_silent[tenant] = peers - shook
        if oldest is not None:
            snap.hub_age[tenant] = _age(now, oldest)
    lo, hi = s.exec(select(func.min(Event.id), func.max(Event.id))).one()  # type: ignore[call-overload]
    snap.event_rows = 0 if lo is None else hi - lo + 1
    beats = s.exec(
        select(Instance.name, Instance.heartbeat_at).where(Instance.stopped_at.is_(None))  # type: ignore[union-attr]
    ).all()
    snap.heartbeat_age = {name: _age(now, at) for name, at in beats}
    return snap


def _age(now: datetime, then: datetime) -> float:
    return max((now - as_utc(then)).total_seconds(), 0.0)


def publish(snap: Snapshot, networks: list[DhcpNetwork]) -> None:
    """Set the gauges from a snapshot (values that disappeared are removed)."""
    metrics.set_counts(metrics.machines_by_state, snap.machines, [st.value for st in State])
    metrics.set_counts(
        metrics.dhcp_pool_size,
        {n: hi - lo + 1 for n, (lo, hi) in _pool_bounds(networks).items()},
    )
    metrics.set_counts(metrics.dhcp_pool_used, snap.pool_used)
    metrics.set_counts(metrics.claims_by_state, snap.claims, metrics.CLAIM_STATES)
    metrics.set_counts(metrics.bmcs_by_health, snap.bmcs, metrics.BMC_HEALTH)
    metrics.set_counts(metrics.hub_peers, snap.hub_peers)
    metrics.set_counts(metrics.hub_peers_silent, snap.hub_silent)
    metrics.set_counts(metrics.hub_handshake_age, snap.hub_age)
    metrics.event_rows.set(snap.event_rows)
    metrics.set_counts(metrics.instance_heartbeat_age, snap.heartbeat_age)


async def refresh(store: object, networks: list[DhcpNetwork]) -> None:
    """Refresh the store gauges; a failed read is counted and leaves the last values."""
    try:
        snap = await store.run(snapshot, networks)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - the scrape still answers with what it has
        metrics.scrape_errors.inc()
        return
    publish(snap, networks)
