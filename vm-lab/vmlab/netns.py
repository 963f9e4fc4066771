"""The lab's network namespace: its bridge, its taps and its addresses.

Everything lives inside the namespace, so deleting the namespace (after its processes are gone)
removes the bridge and the taps with it. The namespace has no route out: only the lab's own
subnet is reachable from inside. Creating, deleting and entering namespaces is netconfig's
(the same code metald runs); the lab adds its bridge, taps and the processes inside.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from pyroute2 import IPRoute

from netconfig.netns import NETNS_DIR, NetnsError, create, delete, exec_argv, exists, links

__all__ = [
    "NETNS_DIR",
    "NetnsError",
    "add_bridge",
    "add_taps",
    "add_veth_to_bridge",
    "create",
    "delete",
    "exec_argv",
    "exists",
    "links",
    "list_namespaces",
    "pids",
]


def list_namespaces(prefix: str) -> list[str]:
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))


def add_bridge(ns: str, bridge: str, addresses: Iterable[str], prefixlen: int) -> None:
    """A bridge that forwards at once (forward_delay 0, no STP) holding the lab's addresses."""
    with IPRoute(netns=ns) as ipr:
        # Multicast snooping off: Router Solicitations/Advertisements and DHCPv6 must reach
        # every port even though no MLD querier runs on the lab segment.
        ipr.link(
            "add",
            ifname=bridge,
            kind="bridge",
            br_forward_delay=0,
            br_stp_state=0,
            br_mcast_snooping=0,
        )
        (index,) = ipr.link_lookup(ifname=bridge)
        for address in addresses:
            ipr.addr("add", index=index, address=address, prefixlen=prefixlen)
        ipr.link("set", index=index, state="up")


def add_taps(ns: str, bridge: str, taps: Sequence[str]) -> None:
    """Persistent taps on the bridge, created inside the namespace so QEMU there opens them."""
    with IPRoute(netns=ns) as ipr:
        (br_index,) = ipr.link_lookup(ifname=bridge)
        for tap in taps:
            ipr.link("add", ifname=tap, kind="tuntap", mode="tap")
            (index,) = ipr.link_lookup(ifname=tap)
            ipr.link("set", index=index, master=br_index, state="up")


def add_veth_to_bridge(
    ns: str, bridge: str, outer: str, inner: str, peer_ns: str, address: str, prefixlen: int
) -> None:
    """A veth pair: ``outer`` on the bridge in ``ns``, ``inner`` in ``peer_ns`` with ``address``."""
    with IPRoute(netns=ns) as ipr:
        ipr.link("add", ifname=outer, kind="veth", peer=inner)
        (br_index,) = ipr.link_lookup(ifname=bridge)
        (outer_index,) = ipr.link_lookup(ifname=outer)
        (inner_index,) = ipr.link_lookup(ifname=inner)
        ipr.link("set", index=inner_index, net_ns_fd=peer_ns)
        ipr.link("set", index=outer_index, master=br_index, state="up")
    with IPRoute(netns=peer_ns) as ipr:
        (index,) = ipr.link_lookup(ifname=inner)
        ipr.addr("add", index=index, address=address, prefixlen=prefixlen)
        ipr.link("set", index=index, state="up")


def _inode(path: str | Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def pids(ns: str) -> list[int]:
    """Processes whose network namespace is ``ns`` (what ``ip netns pids`` reports)."""
    target = _inode(NETNS_DIR / ns)
    if target is None:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _inode(f"/proc/{entry}/ns/net") == target:
            found.append(int(entry))
    return found
