"""A tenant node's place on its tenant's hub: the one-time join token an orchestrator
issues, the node's first-boot join with it, and revoking the node's peer.

After the commit, a join or a revoked peer is applied to the running hub (when this daemon
runs the hubs; else the hub picks the stored peers up when it is next started or synced) and
wakes the tenant's mesh long-polls."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlmodel import Session

from metald.auth import Principal
from metald.errors import NotFound
from metald.machines import get_machine
from metald.secrets import SecretBox
from metald.store.models import Machine
from metald.tenants import clusters
from metald.tenants.hubs import HubRuntime
from metald.usecases import Transactions
from metald.usecases.tenants import peer_view

log = logging.getLogger("metald.tenants")


class MeshChanged(Protocol):
    """The tenant mesh's watch (``metald.tenants.mesh.MeshWatch``): wakes the tenant's
    long-polls."""

    def changed(self, tenant_id: str) -> None: ...


def _machine_of(s: Session, p: Principal, machine_id: str) -> Machine:
    m = get_machine(s, machine_id)
    if not p.can_see_machine(m.id, m.tenant_id):
        raise NotFound(f"no machine with id {machine_id!r}")
    return m


@dataclass
class Join:
    store: Transactions
    secrets: SecretBox
    instance: str
    #: Wakes the live event streams after a commit.
    notify: Callable[[], None]
    #: The tenant mesh's watch.
    mesh: MeshChanged
    #: The running hubs; None when this daemon runs none.
    hubs: HubRuntime | None

    async def join(self, secret: str, public_key: str, *, registered_from: str | None) -> Any:
        """Burn the join token and record the node's peer (``clusters.join``); then add the
        peer to its running hub. Answers the node's join material (``JoinResult.response``)."""
        result = await self.store.run(
            lambda s: clusters.join(
                s,
                self.secrets,
                secret,
                public_key,
                instance=self.instance,
                registered_from=registered_from,
            )
        )
        self.mesh.changed(result.hub.tenant_id)
        if self.hubs is not None:  # else the stored peer is applied when the hub is (re)started
            try:
                await asyncio.to_thread(
                    self.hubs.add_peer,
                    result.hub.tenant_id,
                    result.peer.public_key,
                    result.peer.address,
                )
            except Exception:  # the peer is stored; the hub picks it up when it is restarted
                log.exception(
                    "could not add the peer of machine %s to its hub", result.peer.machine_id
                )
        return result.response()

    async def issue_token(
        self, p: Principal, machine_id: str, *, actor: str, ttl: timedelta
    ) -> tuple[str, str, datetime]:
        """A one-time join token for a machine the caller may see: (machine id, secret,
        expiry)."""

        def run(s: Session) -> tuple[str, str, datetime]:
            m = _machine_of(s, p, machine_id)
            secret, expires = clusters.issue_join_token(
                s, m.id, actor=actor, ttl=ttl, instance=self.instance
            )
            return m.id, secret, expires

        return await self.store.run(run)

    async def revoke_peer(self, p: Principal, machine_id: str, *, actor: str) -> dict[str, Any]:
        """Take the machine's peer off its tenant's hub (``clusters.remove_peer``), in the
        store and then on the running hub."""

        def run(s: Session) -> tuple[dict[str, Any], str]:
            m = _machine_of(s, p, machine_id)
            peer = clusters.remove_peer(
                s, m.id, actor=actor, instance=self.instance, reason="revoked"
            )
            if peer is None:
                raise NotFound(f"machine {m.id} has no peer on a tenant's hub")
            s.commit()
            return peer_view(peer), peer.tenant_id

        try:
            out, tenant_id = await self.store.run(run)
        finally:
            self.notify()
        self.mesh.changed(tenant_id)
        if self.hubs is not None:  # else the hub drops it when it next syncs with the store
            try:
                await asyncio.to_thread(self.hubs.remove_peer, tenant_id, out["public_key"])
            except Exception:
                log.exception("could not take machine %s's peer off its hub", out["machine_id"])
        return out
