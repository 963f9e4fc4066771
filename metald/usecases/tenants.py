"""Tenants and their WireGuard hubs as the API shows and changes them: create, list, show; a
tenant's hub (created, then brought up on the running hubs at once) and fabric partition.

A tenant outside an orchestrator's scope is reported as absent, not forbidden."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Protocol

from sqlmodel import Session, col, select

from metald.auth import Principal, Role
from metald.errors import NotFound, Unprocessable
from metald.secrets import SecretBox
from metald.store.models import Tenant, WgPeer
from metald.tenants import clusters, fabric
from metald.tenants.runtime import free_hub_address
from metald.usecases import Transactions
from metald.usecases.reads import Page, Pager, page

#: By name.
DEFAULT_ORDER = ["name", "id"]


class HubSync(Protocol):
    """The tenant runtime (``metald.tenants.runtime``): brings the running hubs in line with
    the store now rather than at its next interval (its errors are logged there)."""

    async def sync(self) -> object: ...


def tenant_view(t: Tenant) -> dict[str, Any]:
    return t.model_dump()


def peer_view(peer: WgPeer) -> dict[str, Any]:
    """A node on a hub, as the API shows it (never its node token)."""
    return {
        "machine_id": peer.machine_id,
        "address": peer.address,
        "public_key": peer.public_key,
        "last_handshake_at": peer.last_handshake_at,
    }


def hub_view(s: Session, tenant: Tenant) -> dict[str, Any]:
    """The tenant's hub: public key, endpoint, overlay prefix and peers (never a private key);
    NotFound while it has none."""
    hub = clusters.get_hub(s, tenant.id)
    return {
        "tenant_id": tenant.id,
        "cluster_kind": tenant.cluster_kind,
        "ifname": hub.ifname,
        "public_key": hub.public_key,
        "endpoint": hub.endpoint,
        "listen_port": hub.listen_port,
        "address": hub.address,
        "overlay_prefix": tenant.overlay_prefix or "",
        "peers": [peer_view(p) for p in clusters.peers(s, tenant.id)],
    }


def load_visible(s: Session, p: Principal, tenant_id: str) -> Tenant:
    t = s.get(Tenant, tenant_id)
    if t is None or not p.can_see_tenant(t.id):
        raise NotFound(f"no tenant with id {tenant_id!r}")
    return t


def _views(_: Session, rows: list[Tenant]) -> list[dict[str, Any]]:
    return [tenant_view(t) for t in rows]


@dataclass
class Tenants:
    store: Transactions
    secrets: SecretBox
    instance: str
    #: tenants.vlan_range: where new tenants' VLANs come from.
    vlan_range: Any
    #: tenants.hub_addresses: where a hub's endpoint comes from when none is given.
    hub_addresses: ipaddress.IPv4Network | None
    #: The running hubs; None when this daemon runs none.
    hubs: HubSync | None

    async def create(
        self, *, actor: str, name: str, cluster_kind: str, control_plane: Any
    ) -> dict[str, Any]:
        """A tenant that orchestrator tokens can be scoped to."""

        def run(s: Session) -> dict[str, Any]:
            t = clusters.add_tenant(
                s,
                name=name,
                cluster_kind=cluster_kind,
                control_plane=control_plane,
                vlan_range=self.vlan_range,
                actor=actor,
                instance=self.instance,
            )
            return tenant_view(t)

        return await self.store.run(run)

    async def list(self, p: Principal, pager: Pager) -> Page[dict[str, Any]]:
        """Tenants by name; an orchestrator's only those in its scope."""

        def run(s: Session) -> Page[dict[str, Any]]:
            stmt = select(Tenant)
            if p.role is Role.ORCHESTRATOR:
                stmt = stmt.where(col(Tenant.id).in_(sorted(p.scope)))
            return page(s, stmt, Tenant, pager, DEFAULT_ORDER, _views)

        return await self.store.read(run)

    async def show(self, p: Principal, tenant_id: str) -> dict[str, Any]:
        return await self.store.run(lambda s: tenant_view(load_visible(s, p, tenant_id)))

    async def create_hub(
        self, p: Principal, tenant_id: str, *, endpoint_host: str | None, listen_port: int
    ) -> dict[str, Any]:
        """Give the tenant its hub (``clusters.setup_hub``); then bring it up on the running
        hubs now, not at their next interval."""
        pool = self.hub_addresses

        def run(s: Session) -> dict[str, Any]:
            t = load_visible(s, p, tenant_id)
            host = endpoint_host
            if host is None:
                if pool is None:
                    raise Unprocessable(
                        "endpoint_host: required (tenants.hub_addresses is not configured)"
                    )
                host = free_hub_address(s, pool)
            clusters.setup_hub(s, self.secrets, t.id, endpoint_host=host, listen_port=listen_port)
            return hub_view(s, t)

        out = await self.store.run(run)
        if self.hubs is not None:
            await self.hubs.sync()  # up now, not at the next interval (errors are logged there)
        return out

    async def show_hub(self, p: Principal, tenant_id: str) -> dict[str, Any]:
        return await self.store.run(lambda s: hub_view(s, load_visible(s, p, tenant_id)))

    async def show_fabric(self, p: Principal, tenant_id: str) -> dict[str, Any]:
        """The tenant's VLAN, partition key (allocated now if missing), machines and port
        GUIDs, and its OpenSM fragment (``fabric.describe``)."""
        return await self.store.run(lambda s: fabric.describe(s, load_visible(s, p, tenant_id).id))
