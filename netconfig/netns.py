"""Network namespaces and veth pairs (pyroute2). Names are the caller's; nothing is guessed."""

from __future__ import annotations

import os
from pathlib import Path

from pyroute2 import IPRoute, NetNS, netns

NETNS_DIR = Path("/run/netns")


def path(name: str) -> str:
    return str(NETNS_DIR / name)


def create(name: str) -> None:
    """Create the namespace with its loopback up."""
    netns.create(name)
    with NetNS(name) as ns:
        ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")


def delete(name: str) -> None:
    if os.path.exists(path(name)):
        netns.remove(name)


def exists(name: str) -> bool:
    return os.path.exists(path(name))


def veth(a_ns: str, a_if: str, b_ns: str, b_if: str) -> None:
    """A veth pair with one end in each namespace (both down; see ``address``)."""
    with IPRoute() as ip:
        ip.link("add", ifname=a_if, kind="veth", peer={"ifname": b_if})
        for ifname, ns in ((a_if, a_ns), (b_if, b_ns)):
            ip.link("set", index=ip.link_lookup(ifname=ifname)[0], net_ns_fd=ns)


def address(ns_name: str, ifname: str, cidr: str, *, up: bool = True) -> None:
    addr, plen = cidr.split("/")
    with NetNS(ns_name) as ns:
        idx = ns.link_lookup(ifname=ifname)[0]
        ns.addr("add", index=idx, address=addr, prefixlen=int(plen))
        if up:
            ns.link("set", index=idx, state="up")


def link_up(ns_name: str, ifname: str) -> None:
    with NetNS(ns_name) as ns:
        ns.link("set", index=ns.link_lookup(ifname=ifname)[0], state="up")


def links(ns_name: str) -> list[str]:
    with NetNS(ns_name) as ns:
        return [link.get_attr("IFLA_IFNAME") for link in ns.get_links()]
