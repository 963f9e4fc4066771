"""Links in the caller's own network namespace, over netlink (pyroute2's ``IPRoute``, which does
not fork; see ``netns`` for why namespaces themselves go through iproute2): a veth pair from a
host bridge into a namespace, a bridge's network, deleting a link."""

from __future__ import annotations

import ipaddress


class LinkError(RuntimeError):
    pass


def bridge_prefixlen(bridge: str, address: str) -> int:
    """The prefix length of the bridge's IPv4 network that holds ``address``."""
    from pyroute2 import IPRoute

    want = ipaddress.ip_address(address)
    with IPRoute() as ip:
        idx = ip.link_lookup(ifname=bridge)
        if not idx:
            raise LinkError(f"bridge {bridge!r} does not exist here")
        for a in ip.get_addr(index=idx[0], family=2):
            net = ipaddress.ip_network(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}", False)
            if want in net:
                return net.prefixlen
    raise LinkError(f"address {address} is on none of {bridge}'s networks")


def veth_to_bridge(host_if: str, ns: str, ns_if: str, bridge: str, mac: str) -> None:
    """A veth pair: ``host_if`` enslaved to ``bridge`` and up here, ``ns_if`` (link-layer
    address ``mac``) moved into namespace ``ns`` (still down)."""
    from pyroute2 import IPRoute

    with IPRoute() as ip:
        ip.link("add", ifname=host_if, kind="veth", peer={"ifname": ns_if, "address": mac})
        peer = ip.link_lookup(ifname=ns_if)[0]
        ip.link("set", index=peer, net_ns_fd=ns)
        idx = ip.link_lookup(ifname=host_if)[0]
        ip.link("set", index=idx, master=ip.link_lookup(ifname=bridge)[0], state="up")


def delete(ifname: str) -> None:
    """Delete the link if it exists (a veth takes its peer with it)."""
    from pyroute2 import IPRoute

    with IPRoute() as ip:
        idx = ip.link_lookup(ifname=ifname)
        if idx:
            ip.link("del", index=idx[0])
