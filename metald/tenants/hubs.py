"""Running hubs: the thin I/O shell between stored hubs/peers and netconfig's devices.

``LocalHubs`` runs each tenant's hub in its own network namespace on this host (wireguard-go;
kernel WireGuard is not wired yet). The API calls ``add_peer``/``remove_peer`` after the
database commit, so the store stays the record and ``start`` can rebuild a hub from it.
"""

from __future__ import annotations

import ipaddress
from datetime import datetime
from typing import Protocol

from sqlmodel import Session, select

from metald.secrets import SecretBox
from metald.store.models import Tenant, WgHub
from metald.tenants import clusters
from netconfig.uapi import PeerConfig, PeerStatus
from netconfig.wireguard import Hub


class HubRuntime(Protocol):
    def add_peer(self, tenant_id: str, public_key: str, address: str) -> None: ...
    def remove_peer(self, tenant_id: str, public_key: str) -> None: ...
    def handshakes(self, tenant_id: str) -> dict[str, datetime | None]: ...


class LocalHubs:
    def __init__(self) -> None:
        self._hubs: dict[str, Hub] = {}

    def start(
        self,
        *,
        tenant_id: str,
        ns: str,
        ifname: str,
        address: str,
        prefix: str,
        listen_port: int,
        private_key: str,
        peers: list[tuple[str, str]] = (),  # type: ignore[assignment]
        endpoints: dict[str, str] | None = None,
    ) -> Hub:
        """Bring the hub up with its stored peers ((public key, overlay address) pairs).
        ``endpoints``: where peers were last seen; the hub dials those at once (keepalive), so
        nodes get a session again right after a restart instead of at their next rekey."""
        plen = ipaddress.ip_network(prefix).prefixlen
        hub = Hub(ns, ifname, f"{address}/{plen}", listen_port)
        seen = endpoints or {}
        hub.up(
            private_key,
            [
                PeerConfig(
                    k,
                    [f"{a}/32"],
                    endpoint=seen.get(k),
                    persistent_keepalive=clusters.PERSISTENT_KEEPALIVE if seen.get(k) else None,
                )
                for k, a in peers
            ],
        )
        self._hubs[tenant_id] = hub
        return hub

    def start_from_store(self, session: Session, box: SecretBox, tenant_id: str, ns: str) -> Hub:
        """Bring a tenant's hub up in ``ns`` exactly as stored, with every stored peer."""
        hub = session.exec(select(WgHub).where(WgHub.tenant_id == tenant_id)).one()
        tenant = session.get(Tenant, tenant_id)
        assert tenant is not None and tenant.overlay_prefix is not None
        return self.start(
            tenant_id=tenant_id,
            ns=ns,
            ifname=hub.ifname,
            address=hub.address,
            prefix=tenant.overlay_prefix,
            listen_port=hub.listen_port,
            private_key=clusters.hub_private_key(box, hub),
            peers=[(p.public_key, p.address) for p in clusters.peers(session, tenant_id)],
        )

    def add_peer(self, tenant_id: str, public_key: str, address: str) -> None:
        self._hubs[tenant_id].add_peer(public_key, address)

    def remove_peer(self, tenant_id: str, public_key: str) -> None:
        self._hubs[tenant_id].remove_peer(public_key)

    def handshakes(self, tenant_id: str) -> dict[str, datetime | None]:
        return {p.public_key: p.last_handshake for p in self._hubs[tenant_id].peers()}

    def status(self, tenant_id: str) -> dict[str, PeerStatus]:
        return {p.public_key: p for p in self._hubs[tenant_id].peers()}

    def pid(self, tenant_id: str) -> int | None:
        """The wireguard-go process of a tenant's hub (for stale-process cleanup)."""
        dev = self._hubs[tenant_id].device
        return dev.proc.pid if dev is not None and dev.proc is not None else None

    def stop_one(self, tenant_id: str) -> None:
        self._hubs.pop(tenant_id).down()

    def stop(self) -> None:
        for hub in self._hubs.values():
            hub.down()
        self._hubs.clear()
