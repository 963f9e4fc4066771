"""The tenants page's hubs, peers and nodes for all listed tenants at once: three statements
whatever the number of tenants (not one hub and one machines call per tenant). A pure
function over a store ``Session``.

The tenants themselves come from the API's own list route (scoped to the caller); the nodes
are filtered again by the fleet's scope rule (``api.ui.fleet.scope``), and a hub is shown with
the fields the API's ``GET /api/v1/tenants/{id}/hub`` shows (never its private key)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from sqlmodel import Session, col, select

from api.ui.fleet import scope
from metald.auth import Principal
from metald.store.models import Machine, WgHub, WgPeer


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
        hubs[peer.tenant_id]["peers"].append(
            {
                "machine_id": peer.machine_id,
                "address": peer.address,
                "public_key": peer.public_key,
                "last_handshake_at": peer.last_handshake_at,
            }
        )
    nodes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    machines = s.exec(
        select(Machine.id, Machine.name, Machine.state, Machine.tenant_id)
        .where(col(Machine.tenant_id).in_(tenant_ids), *scope(p))
        .order_by(col(Machine.name), col(Machine.id))
    )
    for mid, name, state, tenant_id in machines:
        nodes[tenant_id].append({"id": mid, "name": name, "state": state})
    return TenantDetails(hubs, dict(nodes))


__all__ = ["TenantDetails", "tenant_details"]
