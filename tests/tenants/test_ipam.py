"""Overlay prefixes never overlap; node addresses are never handed out twice while held."""

from __future__ import annotations

import ipaddress

import pytest

from metald.tenants import ipam


def test_prefixes_do_not_overlap() -> None:
    taken: list[str] = []
    for _ in range(50):
        taken.append(ipam.allocate_prefix(taken))
    nets = [ipaddress.ip_network(p) for p in taken]
    assert len(set(nets)) == 50
    assert all(not a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1 :])
    assert all(n.subnet_of(ipaddress.ip_network("100.64.0.0/10")) for n in nets)


def test_prefix_skips_foreign_overlaps() -> None:
    # A wider prefix someone else holds covers several /24s: none of them is handed out.
    got = ipam.allocate_prefix(["100.64.0.0/22"], supernet="100.64.0.0/16")
    assert got == "100.64.4.0/24"


def test_prefix_exhaustion() -> None:
    with pytest.raises(ipam.IpamExhausted):
        ipam.allocate_prefix(["10.0.0.0/24", "10.0.1.0/24"], supernet="10.0.0.0/23")


def test_hub_takes_first_host_and_nodes_the_rest() -> None:
    prefix = "100.64.3.0/29"
    assert ipam.hub_address(prefix) == "100.64.3.1"
    held: list[str] = []
    for _ in range(5):
        held.append(ipam.allocate_address(prefix, held))
    assert held == [f"100.64.3.{i}" for i in range(2, 7)]
    with pytest.raises(ipam.IpamExhausted):
        ipam.allocate_address(prefix, held)
    # Released addresses come back; held ones never do.
    held.remove("100.64.3.4")
    assert ipam.allocate_address(prefix, held) == "100.64.3.4"
