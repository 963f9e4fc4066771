"""Tenant nodes reach only metald's join, agent and boot endpoints.

A machine allocated to a tenant runs the tenant's software, and the tenant has root on it. On
the provisioning network it can still open metald's API port: it needs ``POST /api/v1/join``,
``POST /api/v1/mesh`` (its tenant's mesh view, with its node token), the agent endpoints
(deploy agent, rejoin) and ``/boot/`` (iPXE on every reboot), and nothing
else. The API answers requests from those machines' addresses (the leases metald's DHCP bound
to their MACs) on any other path with 403 before looking at a token, so a tenant cannot probe
the rest of the API, token or not. The address set is read from the store every few seconds:
a claim or release takes effect within ``interval_s``, well before a claimed machine runs
anything of the tenant's (it first boots metald's deploy agent and writes its image).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

from sqlmodel import Session, col, select

from metald.service import TaskScope, cancel
from metald.store.db import Store
from metald.store.models import Lease, Machine, Nic, as_utc

log = logging.getLogger(__name__)

#: What a tenant's machine may ask metald for.
ALLOWED_PATHS = frozenset({"/api/v1/join", "/api/v1/mesh", "/api/v1/health/report"})
ALLOWED_PREFIXES = ("/api/v1/agent/", "/boot/")


def path_allowed(path: str) -> bool:
    return path in ALLOWED_PATHS or path.startswith(ALLOWED_PREFIXES)


def tenant_node_addresses(s: Session) -> set[str]:
    """Addresses bound (unexpired leases) to the MACs of machines allocated to a tenant."""
    now = datetime.now(UTC)
    rows = s.exec(
        select(Lease.ip, Lease.expires_at)
        .join(Nic, col(Nic.mac) == col(Lease.mac))
        .join(Machine, col(Machine.id) == col(Nic.machine_id))
        .where(col(Machine.tenant_id).is_not(None), Lease.state == "bound")
    )
    out = set()
    for ip, expires in rows:
        if as_utc(expires) > now:
            out.add(ip)
    return out


class TenantNodeGuard:
    """Keeps the set of tenant machines' addresses the API middleware checks."""

    name = "tenant_node_guard"

    def __init__(
        self, store: Store, *, interval_s: float = 5.0, tasks: TaskScope | None = None
    ) -> None:
        self.store = store
        self.interval_s = interval_s
        self.addresses: frozenset[str] = frozenset()
        self.refused = 0
        self.tasks = tasks if tasks is not None else TaskScope(self.name)
        self._task: asyncio.Task[None | None] | None = None

    def refuses(self, remote: str | None, path: str) -> bool:
        if remote is None or remote not in self.addresses or path_allowed(path):
            return False
        self.refused += 1
        return True

    async def refresh(self) -> None:
        self.addresses = frozenset(await self.store.run(tenant_node_addresses))

    async def start(self) -> None:
        await self.refresh()
        await self.tasks.open()
        self._task = self.tasks.spawn(self._loop(), name="tenant-node-guard")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # keep the last set; the store may be briefly unavailable
                log.exception("reading tenant machines' addresses failed")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
        await self.tasks.close()
