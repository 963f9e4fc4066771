"""How fast DHCP may report clients to enrollment: token buckets per relay, per switch port,
per source address and in total. Pure; the caller passes the time.

Every network-booting client DHCP has not reported lately is handed to the boot hooks, which
create a ``discovered`` machine for a MAC they do not know. Without a limit, a flood of
DISCOVERs from made-up MACs grows the machine table by one row per packet. A report goes
ahead only if every bucket that applies to the packet has a token, and then takes one from
each; a refused client is not marked as reported, so its next DHCP packet tries again.

Which buckets apply:
- ``relay``: the relay's giaddr, or the receiving interface for clients on the wire.
- ``port``: option 82 remote id + circuit id (the switch port), under the relay's key, when
  the packet carries a circuit id. Not trusted for anything but this extra limit: a client on
  the wire can write its own option 82, which only puts it in a bucket of its choosing while
  the relay, source and total buckets still apply.
- ``source``: the datagram's source address (the relay itself, or 0.0.0.0 for clients on the
  wire): a sender that forges many giaddrs still shares one bucket...
- ``total``: ...unless it forges its source address too; this one is never evicted.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from metald.boot.dhcp.packet import ZERO, DhcpPacket, MalformedPacket, RelaySub

#: Most keys per bucket kind remembered; past it, full buckets and then the oldest are
#: forgotten (a forgotten bucket is full). The total bucket bounds what forgetting gives away.
MAX_KEYS = 16384


@dataclass(frozen=True, slots=True)
class Rate:
    """A token bucket: at most ``burst`` reports at once, refilled at ``per_s`` a second.
    ``burst`` 0 turns the limit off."""

    burst: float
    per_s: float


@dataclass(frozen=True, slots=True)
class EnrollLimits:
    """Defaults sized for a power-on storm: 1,000 machines behind one relay all report at
    once (the burst), and a hall of several thousand behind one relay is reported within
    tens of seconds while PXE retransmits; a switch port normally carries one machine."""

    relay: Rate = Rate(1000, 200)
    port: Rate = Rate(8, 1 / 60)
    source: Rate = Rate(1000, 200)
    total: Rate = Rate(2000, 200)

    @classmethod
    def from_config(cls, cfg: Any) -> EnrollLimits:
        """From ``[boot.dhcp_enroll_limit]``; a source address gets what a relay gets."""
        relay = Rate(cfg.relay_burst, cfg.relay_per_s)
        return cls(
            relay=relay,
            port=Rate(cfg.port_burst, cfg.port_per_min / 60),
            source=relay,
            total=Rate(cfg.total_burst, cfg.total_per_s),
        )


class TokenBuckets:
    """Token buckets of one rate, by key. A key not in the map is a full bucket."""

    def __init__(self, rate: Rate, max_keys: int = MAX_KEYS) -> None:
        self.rate = rate
        self.max_keys = max_keys
        #: key -> (tokens, when last updated).
        self._buckets: dict[Hashable, tuple[float, float]] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def tokens(self, key: Hashable, now: float) -> float:
        got = self._buckets.get(key)
        if got is None:
            return self.rate.burst
        tokens, then = got
        # max(0, ...): a clock stepping back refills nothing rather than going negative.
        return min(self.rate.burst, tokens + max(0.0, now - then) * self.rate.per_s)

    def has(self, key: Hashable, now: float) -> bool:
        return self.rate.burst <= 0 or self.tokens(key, now) >= 1.0

    def take(self, key: Hashable, now: float) -> None:
        if self.rate.burst <= 0:
            return
        left = self.tokens(key, now) - 1.0
        b = self._buckets
        if key not in b and len(b) >= self.max_keys:
            self._forget(now)
        b.pop(key, None)  # re-inserted at the end: the map stays in order of last use
        b[key] = (left, now)

    def _forget(self, now: float) -> None:
        b = self._buckets
        full = [k for k in b if self.tokens(k, now) >= self.rate.burst]
        for k in full:
            del b[k]
        if len(b) >= self.max_keys:
            for k in list(b)[: max(1, self.max_keys // 4)]:  # least recently used first
                del b[k]


@dataclass(frozen=True, slots=True)
class EnrollKeys:
    """What one packet is charged to."""

    relay: Hashable
    source: Hashable
    port: Hashable | None = None


class EnrollLimiter:
    def __init__(self, limits: EnrollLimits | None = None, max_keys: int = MAX_KEYS) -> None:
        self.limits = limits or EnrollLimits()
        lim = self.limits
        self.relay = TokenBuckets(lim.relay, max_keys)
        self.port = TokenBuckets(lim.port, max_keys)
        self.source = TokenBuckets(lim.source, max_keys)
        self.total = TokenBuckets(lim.total, 1)

    def admit(self, keys: EnrollKeys, now: float) -> str | None:
        """Take a token from every bucket that applies and return None, or take none and
        return the name of the first limit that refused ("port", "relay", "source", "total")."""
        checks: list[tuple[str, TokenBuckets, Hashable]] = []
        if keys.port is not None:
            checks.append(("port", self.port, keys.port))
        checks += [
            ("relay", self.relay, keys.relay),
            ("source", self.source, keys.source),
            ("total", self.total, None),
        ]
        for name, buckets, key in checks:
            if not buckets.has(key, now):
                return name
        for _, buckets, key in checks:
            buckets.take(key, now)
        return None


def keys_for(pkt: DhcpPacket, src: tuple[str, int], interface: str) -> EnrollKeys:
    """The buckets a packet from ``src``, received on ``interface``, is charged to."""
    gi = pkt.giaddr
    relay: Hashable = int(gi) if gi != ZERO else interface  # int vs str: never equal
    port = None
    try:
        ra = pkt.relay_agent
    except MalformedPacket:
        ra = None
    if ra:
        circuit = ra.get(RelaySub.CIRCUIT_ID)
        if circuit:
            port = (relay, ra.get(RelaySub.REMOTE_ID, b""), circuit)
    return EnrollKeys(relay, src[0], port)
