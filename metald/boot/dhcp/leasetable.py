"""DHCP leases in memory: the table the decision core reads. Pure (no I/O, no clock).

Records are values (immutable): the core builds new ones and returns them in its decision; the
shell ``apply``s them to the table, and ``metald.boot.dhcp.lease_store.LeaseStore`` makes them durable.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from enum import StrEnum
from ipaddress import IPv4Address
from typing import NamedTuple


class LeaseState(StrEnum):
    OFFERED = "offered"  # in memory only: an offer is a promise, not a handout
    BOUND = "bound"
    RELEASED = "released"
    DECLINED = "declined"  # someone else answers ARP for it; quarantined until expires_at


_HOLDING = (LeaseState.BOUND, LeaseState.OFFERED, LeaseState.DECLINED)


class LeaseRecord(NamedTuple):
    """One address's lease. A tuple: cheaper to build than a frozen dataclass, and immutable."""

    network: str
    ip: IPv4Address
    mac: str
    state: LeaseState
    #: Unix time.
    expires_at: float
    client_id: str | None = None
    hostname: str | None = None

    def holds(self, now: float) -> bool:
        """Whether the address is unavailable to other clients at ``now``."""
        return self.state in _HOLDING and self.expires_at > now


class LeaseTable:
    """Per network: address -> record and MAC -> address. Pure; the caller passes the time.

    Keyed inside by the address as an int: IPv4Address hashes in Python (hash(hex(int))), and
    the hot path does several lookups per packet."""

    def __init__(self) -> None:
        self._by_ip: dict[str, dict[int, LeaseRecord]] = {}
        self._by_mac: dict[str, dict[str, IPv4Address]] = {}
        self._cursor: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_ip.values())

    def records(self) -> Iterator[LeaseRecord]:
        for by_ip in self._by_ip.values():
            yield from by_ip.values()

    def get(self, network: str, ip: IPv4Address) -> LeaseRecord | None:
        by_ip = self._by_ip.get(network)
        return None if by_ip is None else by_ip.get(int(ip))

    def for_mac(self, network: str, mac: str) -> LeaseRecord | None:
        """The MAC's current record (its offer or binding): the last one put for it."""
        by_mac = self._by_mac.get(network)
        ip = None if by_mac is None else by_mac.get(mac)
        if ip is None:
            return None
        rec = self._by_ip[network].get(int(ip))
        # A record taken over in place (another instance holds the address) is not the MAC's.
        return rec if rec is not None and rec.mac == mac else None

    def put(self, rec: LeaseRecord) -> None:
        by_ip = self._by_ip.get(rec.network)
        if by_ip is None:
            by_ip = self._by_ip[rec.network] = {}
            self._by_mac[rec.network] = {}
        by_mac = self._by_mac[rec.network]
        key = int(rec.ip)
        old = by_ip.get(key)
        if old is not None and old.mac != rec.mac and by_mac.get(old.mac) == rec.ip:
            del by_mac[old.mac]
        by_ip[key] = rec
        if rec.mac:
            by_mac[rec.mac] = rec.ip

    def apply(self, puts: Iterable[LeaseRecord]) -> None:
        """Put a decision's records, in order (a released binding before the new offer)."""
        for rec in puts:
            self.put(rec)

    def lost(self, rec: LeaseRecord, until: float) -> None:
        """``rec``'s write lost the address to another instance: hold it as nobody's until
        ``until`` so it is not offered again meanwhile, unless the table moved on since."""
        if self.get(rec.network, rec.ip) is rec:
            self.put(rec._replace(mac="", expires_at=until))

    def learn(self, rec: LeaseRecord, now: float) -> None:
        """A record read from the store (another instance wrote it). It replaces what this
        table holds for the address, except where the table holds the address and the store
        says it is free: this table's offers are never in the store, and its own bindings may
        not have committed yet, so it keeps them (at worst an address stays held until its
        expiry: never given twice)."""
        cur = self.get(rec.network, rec.ip)
        if cur is not None and cur.holds(now) and not rec.holds(now):
            return
        self.put(rec)

    def seek(self, network: str, offset: int) -> None:
        """Start the next free-address search ``offset`` addresses into the pool. Instances
        sharing a pool start at different places, so two rarely pick one address at once."""
        self._cursor[network] = offset

    def available_to(self, network: str, ip: IPv4Address, mac: str, now: float) -> bool:
        rec = self.get(network, ip)
        return (
            rec is None or rec.mac == mac and rec.state != LeaseState.DECLINED or not rec.holds(now)
        )

    def find_free(
        self,
        network: str,
        start: IPv4Address,
        end: IPv4Address,
        now: float,
        skip: frozenset[IPv4Address] = frozenset(),
    ) -> IPv4Address | None:
        """Next address in [start, end] nobody holds, continuing where the last search
        stopped so a burst of new clients does not rescan the same held addresses."""
        lo, hi = int(start), int(end)
        size = hi - lo + 1
        cur = self._cursor.get(network, 0) % size
        by_ip = self._by_ip.get(network, {})
        for i in range(size):
            off = (cur + i) % size
            rec = by_ip.get(lo + off)
            # Prefer never-used addresses; a released/expired one may still be reused.
            if rec is None or not rec.holds(now):
                ip = IPv4Address(lo + off)
                if skip and ip in skip:
                    continue
                self._cursor[network] = off + 1
                return ip
        return None
