"""The DHCP server's view of the fleet: which clients this instance answers, and whether it
may answer at all. Built from ``metald.fleet.membership.Membership``; rebuilt when the live set
changes (``Membership.on_change``), so the per-packet check is one hash and a tuple lookup.

- Several live instances serving a network (their ``serves["provisioning_networks"]`` hold its
  subnet): each answers the clients in its buckets (``balance.Split``), and any client whose
  ``secs`` reached ``takeover_secs``.
- One: it answers everyone (no hashing on the hot path).
- Fenced (no heartbeat written for ``dead_after_s - heartbeat_s``: cut off from the store):
  it answers nobody. It could not make a lease durable, and the others take its clients once
  they judge it dead.
"""

from __future__ import annotations

import logging
from typing import Protocol

from metald.boot.dhcp.balance import Split, bucket_owners
from metald.boot.dhcp.common import NetworkPlan
from metald.boot.dhcp.packet import DhcpPacket
from metald.fleet.registry import Member

log = logging.getLogger(__name__)


class FleetView(Protocol):
    """What DhcpPeers needs of ``Membership``."""

    instance: str

    @property
    def fenced(self) -> bool: ...

    def live(self) -> list[Member]: ...


def serving(members: list[Member], net: NetworkPlan) -> list[str]:
    subnet = str(net.subnet)
    return [m.name for m in members if subnet in (m.serves.get("provisioning_networks") or [])]


class DhcpPeers:
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
        self.rebuild()

    def rebuild(self) -> None:
        """Recompute the buckets from the live members (call on every membership change)."""
        live = self.fleet.live()
        me = self.fleet.instance
        splits: dict[str, Split] = {}
        for net in self.networks:
            names = set(serving(live, net)) | {me}
            if len(names) > 1:
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
