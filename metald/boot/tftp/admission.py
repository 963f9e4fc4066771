"""Which transfers the TFTP server holds: a per-client-address cap and a global cap. Pure.

A request's source address is spoofable, so a transfer proves nothing until the client ACKs
(it received our first packet at that address). When a cap is reached, the oldest
*unconfirmed* transfer in its scope makes room: spoofed requests can then only push out other
unconfirmed ones, never a client that answered, and a real client, whose first ACK comes one
round trip after its request, is pushed out only by a flood of cap-many requests within that
round trip. Failing that, the oldest transfer in the scope is pushed out if it has run for
``stale_after`` seconds: a boot loader's fetch takes about a second, so under pressure a client
that keeps transfers alive by ACKing slowly loses them to new requests. Only when every
transfer in the scope is confirmed and younger than that is a request refused.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass
class Admission(Generic[K]):
    admitted: bool
    #: Metric label when refused: "refused-per-client" or "busy".
    reason: str = ""
    #: Transfers removed to make room, each with its metric label ("evicted-unconfirmed" or
    #: "evicted-stale"); the caller closes them.
    evicted: list[tuple[K, str]] = field(default_factory=list)


class TransferTable(Generic[K]):
    def __init__(self, max_total: int, max_per_client: int, stale_after: float = 30.0) -> None:
        if max_total < 1 or max_per_client < 1:
            raise ValueError("TFTP transfer limits must be at least 1")
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.stale_after = stale_after
        #: Every transfer's address, in arrival order; and when it arrived.
        self._addr: dict[K, str] = {}
        self._since: dict[K, float] = {}
        #: Per address, its transfers in arrival order (dicts as ordered sets).
        self._by_addr: dict[str, dict[K, None]] = {}
        #: Unconfirmed transfers, oldest first.
        self._unconfirmed: dict[K, None] = {}

    def __len__(self) -> int:
        return len(self._addr)

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._addr))

    def __contains__(self, key: object) -> bool:
        return key in self._addr

    def count(self, addr: str) -> int:
        return len(self._by_addr.get(addr, ()))

    @property
    def unconfirmed(self) -> int:
        return len(self._unconfirmed)

    def admit(self, key: K, addr: str, now: float = 0.0) -> Admission[K]:
        """Add ``key`` from ``addr`` (unconfirmed) if the caps allow, evicting as needed."""
        assert key not in self._addr
        evicted: list[tuple[K, str]] = []
        mine = self._by_addr.get(addr)
        if mine is not None and len(mine) >= self.max_per_client:
            victim = self._victim(mine, now, [])
            if victim is None:
                return Admission(False, "refused-per-client")
            evicted.append(victim)
        if len(self._addr) - len(evicted) >= self.max_total:
            victim = self._victim(self._addr, now, [k for k, _ in evicted])
            if victim is None:
                return Admission(False, "busy")
            evicted.append(victim)
        for k, _ in evicted:
            self.remove(k)
        self._addr[key] = addr
        self._since[key] = now
        self._by_addr.setdefault(addr, {})[key] = None
        self._unconfirmed[key] = None
        return Admission(True, evicted=evicted)

    def _victim(
        self, scope: Mapping[K, object], now: float, taken: list[K]
    ) -> tuple[K, str] | None:
        """The scope's oldest unconfirmed transfer; else its oldest one if stale; else None."""
        unconfirmed: Iterable[K] = (
            self._unconfirmed
            if scope is self._addr
            else (k for k in scope if k in self._unconfirmed)
        )
        k = next((k for k in unconfirmed if k not in taken), None)
        if k is not None:
            return k, "evicted-unconfirmed"
        k = next((k for k in scope if k not in taken), None)
        if k is not None and now - self._since[k] >= self.stale_after:
            return k, "evicted-stale"
        return None

    def confirm(self, key: K) -> None:
        self._unconfirmed.pop(key, None)

    def remove(self, key: K) -> None:
        addr = self._addr.pop(key, None)
        if addr is None:
            return
        del self._since[key]
        self._unconfirmed.pop(key, None)
        mine = self._by_addr[addr]
        del mine[key]
        if not mine:
            del self._by_addr[addr]
