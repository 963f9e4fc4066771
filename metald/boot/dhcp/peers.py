"""The DHCP server's view of the fleet: which clients this instance answers, and whether it
may answer at all. Built from ``metald.fleet.membership.Membership``'s member list; the split
is rebuilt only when the set of answering instances changes, so the per-packet check is one
hash and a tuple lookup.

- Several answering instances serve a network (their ``serves["provisioning_networks"]`` hold
  its subnet): each answers the clients in its buckets (``balance.Split``), and any client
  whose ``secs`` reached ``takeover_secs``.
- One: it answers everyone (no hashing on the hot path).
- Fenced (no heartbeat written for ``fence_after_s = dead_after_s - heartbeat_s``: cut off
  from the store): it answers nobody. It could not make a lease durable anyway.

A peer counts as answering while its heartbeat is younger than ``fence_after_s``, not
``dead_after_s``: past that age it has fenced itself by the same rule and answers nothing, so
its clients are taken over then (8 s after its last heartbeat with the defaults, instead of
the 10-12 s of the ownership of BMCs and hubs, which must wait out the dead time). Answering a
client twice for a moment is harmless here: the (network, ip) row decides who gets an address.
The age is the one read at the last refresh plus the time since, checked every ``tick_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from metald.boot.dhcp.balance import Split, bucket_owners
from metald.boot.dhcp.common import NetworkPlan
from metald.boot.dhcp.packet import DhcpPacket
from metald.fleet.registry import Member

log = logging.getLogger(__name__)


class FleetView(Protocol):
    """What DhcpPeers needs of ``Membership``."""

    instance: str
    members: list[Member]
    #: Monotonic time ``members`` was read (its heartbeat ages are as of then).
    members_at: float
    heartbeat_s: float

    @property
    def fenced(self) -> bool: ...

    @property
    def fence_after_s(self) -> float: ...


def serving(members: list[Member], net: NetworkPlan) -> list[str]:
    subnet = str(net.subnet)
    return [m.name for m in members if subnet in (m.serves.get("provisioning_networks") or [])]


def answering(
    members: list[Member], me: str, since_refresh_s: float, fence_s: float
) -> list[Member]:
    """The members that answer DHCP now: this instance, and those alive whose heartbeat (as
    read ``since_refresh_s`` ago) is younger than the fencing age."""
    return [
        m
        for m in members
        if m.name == me or (m.alive and m.heartbeat_age_s + since_refresh_s < fence_s)
    ]


class DhcpPeers:
    name = "dhcp-peers"

    def __init__(
        self, fleet: FleetView, networks: list[NetworkPlan], *, takeover_secs: int
    ) -> None:
        self.fleet = fleet
        self.networks = networks
        self.takeover_secs = takeover_secs
        #: Network name -> its split; absent where this instance is the only one serving it.
        self.splits: dict[str, Split] = {}
        #: Network name -> where in its pool this instance starts looking for free addresses:
        #: its place among the instances serving it, so they allocate from different ends.
        self.pool_starts: dict[str, int] = {}
        self.tick_s = min(0.25, fleet.heartbeat_s / 2)
        self._members: list[Member] | None = None
        self._refreshed = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self.rebuild()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="dhcp-peers")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                self.rebuild()
            except Exception:
                log.exception("rebuilding the DHCP split failed")

    def rebuild(self) -> None:
        """Recompute the buckets from the answering members (cheap when nothing changed)."""
        fleet = self.fleet
        if fleet.members is not self._members:  # Membership replaced the list: a refresh
            # Aged from when it was read (the heartbeat's thread), not from when this loop got
            # round to it: a lagging loop would think its peers' heartbeats younger.
            self._members = fleet.members
            self._refreshed = fleet.members_at
        live = answering(
            fleet.members, fleet.instance, time.monotonic() - self._refreshed, fleet.fence_after_s
        )
        me = fleet.instance
        splits: dict[str, Split] = {}
        for net in self.networks:
            names = set(serving(live, net)) | {me}
            old = self.splits.get(net.name)
            if old is not None and old.names == names:
                splits[net.name] = old
            elif len(names) > 1:
                owners = bucket_owners(net.name, names)
                splits[net.name] = Split(me, owners, self.takeover_secs)
                size = int(net.pool_end) - int(net.pool_start) + 1
                self.pool_starts[net.name] = size * sorted(names).index(me) // len(names)
        if {k: v.owners for k, v in splits.items()} != {
            k: v.owners for k, v in self.splits.items()
        }:
            log.info(
                "DHCP split: %s",
                {n: sorted({o for o in s.owners if o}) for n, s in splits.items()}
                or "this instance answers every client",
            )
        self.splits = splits

    def refusal(self, pkt: DhcpPacket, network: str) -> str | None:
        """Why this instance does not answer ``pkt`` (a metric label), or None."""
        if self.fleet.fenced:
            return "fenced"
        split = self.splits.get(network)
        if split is None or split.answers(pkt.chaddr[: pkt.hlen], pkt.secs):
            return None
        return "peer-client"
