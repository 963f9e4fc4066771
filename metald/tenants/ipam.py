"""Overlay address management. Pure: callers pass what is taken, the database's unique
constraints (tenant overlay prefix; tenant + peer address) settle any race.

Each tenant gets one prefix (default a /24) carved from a supernet (default 100.64.0.0/10,
RFC 6598 shared space). In a tenant's prefix the hub takes the first host; nodes take the next
free host, and an address is never handed out while a peer holds it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

DEFAULT_SUPERNET = "100.64.0.0/10"
DEFAULT_PREFIXLEN = 24


class IpamExhausted(Exception):
    pass


def allocate_prefix(
    taken: Iterable[str],
    *,
    supernet: str = DEFAULT_SUPERNET,
    prefixlen: int = DEFAULT_PREFIXLEN,
) -> str:
    """The first ``/prefixlen`` of ``supernet`` that overlaps none of ``taken``."""
    net = ipaddress.ip_network(supernet)
    used = [ipaddress.ip_network(t) for t in taken]
    for candidate in net.subnets(new_prefix=prefixlen):
        if not any(candidate.overlaps(u) for u in used):
            return str(candidate)
    raise IpamExhausted(f"no free /{prefixlen} left in {supernet}")


def hub_address(prefix: str) -> str:
    """The hub's overlay address: the first host of the tenant's prefix."""
    return str(next(ipaddress.ip_network(prefix).hosts()))


def allocate_address(prefix: str, taken: Iterable[str]) -> str:
    """The first host of ``prefix`` that is neither the hub's nor in ``taken``."""
    net = ipaddress.ip_network(prefix)
    used = {ipaddress.ip_address(a) for a in taken}
    used.add(ipaddress.ip_address(hub_address(prefix)))
    for host in net.hosts():
        if host not in used:
            return str(host)
    raise IpamExhausted(f"no free address left in {prefix}")


def allocate_vlan(taken: Iterable[int | None], low: int, high: int) -> int:
    """The lowest VLAN id in [low, high] no tenant holds."""
    used = {v for v in taken if v is not None}
    for vid in range(low, high + 1):
        if vid not in used:
            return vid
    raise IpamExhausted(f"every VLAN id from {low} to {high} is taken")


#: InfiniBand partition keys a tenant may get: 0x0000 is invalid and 0x7fff is the default
#: partition; the top bit (full membership) is the subnet manager's to set.
PKEY_RANGE = (0x0001, 0x7FFE)


def allocate_pkey(
    taken: Iterable[int | None], low: int = PKEY_RANGE[0], high: int = PKEY_RANGE[1]
) -> int:
    """The lowest partition key in [low, high] no tenant holds (the unique index on
    ``tenants.pkey`` settles a race; a key is free again only once its tenant is gone)."""
    if not PKEY_RANGE[0] <= low <= high <= PKEY_RANGE[1]:
        raise ValueError("a tenant's PKey range lies within 0x0001-0x7ffe")
    used = {p for p in taken if p is not None}
    for pkey in range(low, high + 1):
        if pkey not in used:
            return pkey
    raise IpamExhausted(f"every InfiniBand PKey from {low:#06x} to {high:#06x} is taken")
