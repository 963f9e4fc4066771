"""A DHCP lease row, as metald's DHCP server stores it, for tests of what leases gate."""

from __future__ import annotations

from datetime import timedelta

from metald.store import Store
from metald.store.models import Lease, utcnow


def add_lease(
    store: Store,
    mac: str,
    ip: str,
    *,
    network: str = "prov",
    state: str = "bound",
    ttl_s: int = 3600,
) -> None:
    with store.session() as s:
        s.add(
            Lease(
                network=network,
                ip=ip,
                mac=mac,
                state=state,
                expires_at=utcnow() + timedelta(seconds=ttl_s),
            )
        )
        s.commit()
