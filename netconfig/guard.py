"""nftables guards for hub and node namespaces: on the underlay only WireGuard gets in.

Slurm's daemons listen on every address, so without a guard a node could reach another
tenant's control plane over the underlay (LAB-NOTES). The guard accepts, on the underlay
interfaces, only the hub's WireGuard port and replies to traffic the namespace started; the
overlay (the WireGuard interface) is not filtered here. Rendering is pure; ``apply`` runs nft
inside the namespace.
"""

from __future__ import annotations

import json
import subprocess

from netconfig import netns

TABLE = "metald_guard"


def render(underlay: list[str], *, wireguard_port: int | None = None) -> str:
    """A complete nft script replacing the guard table. ``wireguard_port`` for hubs (they
    accept handshakes); nodes leave it None (they dial out, replies are established)."""
    if not underlay:
        raise ValueError("name at least one underlay interface")
    ifs = "{ " + ", ".join(json.dumps(i) for i in underlay) + " }"
    accept_wg = f"    iifname {ifs} udp dport {wireguard_port} accept\n" if wireguard_port else ""
    return (
        f"table inet {TABLE}\n"
        f"delete table inet {TABLE}\n"
        f"table inet {TABLE} {{\n"
        "  chain input {\n"
        "    type filter hook input priority filter; policy accept;\n"
        f"    iifname {ifs} ct state established,related accept\n"
        f"{accept_wg}"
        f"    iifname {ifs} drop\n"
        "  }\n"
        "  chain forward {\n"
        "    type filter hook forward priority filter; policy accept;\n"
        f"    iifname {ifs} drop\n"
        "  }\n"
        "}\n"
    )


def apply(ns: str, ruleset: str) -> None:
    r = subprocess.run(
        ["nsenter", f"--net={netns.path(ns)}", "nft", "-f", "-"],
        input=ruleset,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"nft refused the guard in {ns}: {r.stderr.strip()}")
