"""nftables guards for hub and node namespaces: on the underlay only WireGuard gets in.

Slurm's daemons listen on every address, so without a guard a node could reach another
tenant's control plane over the underlay (LAB-NOTES). The guard accepts, on the underlay
interfaces, only WireGuard and replies to traffic the namespace started; the overlay (the
WireGuard interface) is not filtered here. A hub accepts its port from anyone (a join is what
admits a node). A node in a tenant mesh accepts its WireGuard port only from the addresses in
the set ``wg_sources``: its tenant's other nodes' endpoints and its hub, kept current from its
mesh view (``render_sources``). Drops are counted. Rendering is pure; ``apply`` runs nft
inside the namespace. The node image renders the same text in shell
(bootassets/node/metald-node ``guard_rules``); a test holds the two equal.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess

from netconfig import netns

TABLE = "metald_guard"
SOURCES = "wg_sources"


def render(
    underlay: list[str],
    *,
    wireguard_port: int | None = None,
    mesh_port: int | None = None,
    tcp_ports: list[int] | None = None,
) -> str:
    """A complete nft script replacing the guard table. ``wireguard_port`` for hubs (they
    accept handshakes from anyone); ``mesh_port`` for mesh nodes (their WireGuard port, from
    the addresses in ``wg_sources`` only); neither for a node that only dials out.
    ``tcp_ports``: new connections accepted from anyone (an installed OS's SSH)."""
    if not underlay:
        raise ValueError("name at least one underlay interface")
    if wireguard_port and mesh_port:
        raise ValueError("a guard is a hub's (wireguard_port) or a mesh node's (mesh_port)")
    for port in tcp_ports or ():
        if not 1 <= port <= 65535:
            raise ValueError(f"TCP port {port} is not 1-65535")
    ifs = "{ " + ", ".join(json.dumps(i) for i in underlay) + " }"
    accept_wg = f"    iifname {ifs} udp dport {wireguard_port} accept\n" if wireguard_port else ""
    sources = ""
    if mesh_port:
        sources = f"  set {SOURCES} {{\n    type ipv4_addr\n  }}\n"
        accept_wg = f"    iifname {ifs} udp dport {mesh_port} ip saddr @{SOURCES} accept\n"
    if tcp_ports:
        ports = ", ".join(str(p) for p in tcp_ports)
        accept_wg += f"    iifname {ifs} tcp dport {{ {ports} }} accept\n"
    return (
        f"table inet {TABLE}\n"
        f"delete table inet {TABLE}\n"
        f"table inet {TABLE} {{\n"
        f"{sources}"
        "  chain input {\n"
        "    type filter hook input priority filter; policy accept;\n"
        f"    iifname {ifs} ct state established,related accept\n"
        f"{accept_wg}"
        f"    iifname {ifs} counter drop\n"
        "  }\n"
        "  chain forward {\n"
        "    type filter hook forward priority filter; policy accept;\n"
        f"    iifname {ifs} counter drop\n"
        "  }\n"
        "}\n"
    )


def render_sources(sources: list[str]) -> str:
    """An nft script that makes ``wg_sources`` exactly ``sources`` (IPv4 addresses), in one
    transaction: no moment where the set is empty."""
    for s in sources:
        ipaddress.IPv4Address(s)  # raises on anything else
    lines = [f"flush set inet {TABLE} {SOURCES}"]
    if sources:
        lines.append(f"add element inet {TABLE} {SOURCES} {{ {', '.join(sources)} }}")
    return "\n".join(lines) + "\n"


def apply(ns: str, ruleset: str) -> None:
    r = subprocess.run(
        ["nsenter", f"--net={netns.path(ns)}", "nft", "-f", "-"],
        input=ruleset,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"nft refused the guard in {ns}: {r.stderr.strip()}")
