"""``metalctl nvlink-domains`` and ``metalctl ib-fabric`` (staff): the fleet by NVLink domain
and InfiniBand leaf, and uploading the fabric's ``ibnetdiscover`` output; ``metalctl claims
topology`` prints a claim's Slurm topology.conf and IMEX files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .client import Client
from .options import Subparsers
from .output import emit, emit_table, table

DOMAIN_COLUMNS = [
    ("DOMAIN", "domain"),
    ("RACKS", "racks_s"),
    ("SIZE", "size"),
    ("FREE", "free"),
    ("DEGRADED", "degraded_s"),
]
MEMBER_COLUMNS = [
    ("SLOT", "slot_number"),
    ("NAME", "name"),
    ("STATE", "state"),
    ("TENANT", "tenant_id"),
    ("READY", "nvlink_ready"),
    ("LEAF", "ib_leaf"),
    ("POWER", "power_domain"),
    ("PROBLEMS", "problems_s"),
]
LEAF_COLUMNS = [("LEAF", "leaf"), ("SIZE", "size"), ("FREE", "free")]


def register(sub: Subparsers) -> None:
    nv = sub.add_parser("nvlink-domains", help="NVLink domains and their members (staff)")
    nv.add_argument("domain", nargs="?", help="show one domain's members (id or its prefix)")
    nv.set_defaults(func=nvlink_domains)
    ib = sub.add_parser("ib-fabric", help="InfiniBand leaves; upload ibnetdiscover (staff)")
    ibsub = ib.add_subparsers(dest="sub", required=True)
    ibsub.add_parser("list", help="leaves and their machines").set_defaults(func=ib_leaves)
    up = ibsub.add_parser("upload", help="replace the fabric's links with ibnetdiscover output")
    up.add_argument("file", help="ibnetdiscover output ('-': standard input)")
    up.set_defaults(func=ib_upload)


def _row(d: dict[str, Any]) -> dict[str, Any]:
    return {
        **d,
        "racks_s": ",".join(d.get("racks") or []),
        "degraded_s": ",".join(d.get("degraded") or []) or "-",
    }


def nvlink_domains(args: argparse.Namespace, c: Client) -> None:
    data = c.call("GET", "/api/v1/nvlink-domains")
    if not args.domain:
        emit_table(args, data, DOMAIN_COLUMNS, row=_row)
        return
    hits = [d for d in data["items"] if d["domain"].startswith(args.domain)]
    if len(hits) != 1:
        raise SystemExit(f"{len(hits)} NVLink domains match {args.domain!r}; give more of its id")
    (d,) = hits
    members = [{**m, "problems_s": "; ".join(m.get("problems") or []) or "-"} for m in d["members"]]
    emit(
        args,
        d,
        lambda d: (
            f"domain {d['domain']}: {d['size']} trays, {d['free']} free, racks "
            f"{','.join(d['racks']) or '-'}\n" + table(members, MEMBER_COLUMNS)
        ),
    )


def ib_leaves(args: argparse.Namespace, c: Client) -> None:
    emit_table(args, c.call("GET", "/api/v1/ib-fabric"), LEAF_COLUMNS)


def ib_upload(args: argparse.Namespace, c: Client) -> None:
    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    r = c.call("PUT", "/api/v1/ib-fabric", {"ibnetdiscover": text})
    emit(
        args,
        r,
        lambda r: (
            f"{r['links']} host ports on {r['switches']} switches; "
            f"{r['machines_changed']} machine(s) changed leaf; "
            + ", ".join(f"{x['leaf']}: {len(x['machines'])}" for x in r["leaves"])
            + (
                f"; {len(r['unmatched_ports'])} port(s) match no machine"
                if r["unmatched_ports"]
                else ""
            )
        ),
    )


def claim_topology(args: argparse.Namespace, c: Client) -> None:
    t = c.call("GET", f"/api/v1/claims/{args.id}/topology")

    def human(t: dict[str, Any]) -> str:
        if args.what == "imex":
            return "\n".join(
                f"# IMEX nodes_config.cfg for NVLink domain {x['nvlink_domain']}\n"
                + x["nodes_config"]
                for x in t["imex_nodes_config"]
            ).rstrip("\n")
        key = "slurm_topology_block" if args.what == "block" else "slurm_topology_tree"
        return str(t[key]).rstrip("\n")

    emit(args, t, human)


def _matrix_text(t: dict[str, Any]) -> str:
    """The machine's topology as text: its places, then the NVLink link matrix (topo -m's
    cells, NIC legend names in place of NICn) and each GPU's links (nvlink -s)."""
    lines = [
        f"machine {t['machine_id']} ({t.get('name') or '-'}): rack {t.get('rack') or '-'}, "
        f"power domain {t.get('power_domain') or '-'}, NVLink domain "
        f"{t.get('nvlink_domain') or '-'} ({'ready' if t.get('nvlink_ready') else 'not ready'}), "
        f"InfiniBand leaf {t.get('ib_leaf') or '-'}"
    ]
    nl = t.get("nvlink_links") or {}
    matrix = nl.get("matrix") or {}
    devices = matrix.get("devices") or []
    if devices:
        names = matrix.get("nic_names") or {}
        cells = matrix.get("cells") or {}
        rows = [
            {"": names.get(r, r), **{names.get(d, d): cells[r].get(d, "") for d in devices}}
            for r in devices
            if r in cells
        ]
        cols = [("", "")] + [(names.get(d, d), names.get(d, d)) for d in devices]
        lines += ["", "link matrix (NV# = # bonded NVLinks):", table(rows, cols)]
    gpus = nl.get("gpus") or []
    if gpus:
        rows = [
            {
                **g,
                "active_s": f"{g['active']}/{g['links']}",
                "inactive_s": "all"
                if g.get("all_inactive")
                else ",".join(map(str, g["inactive"])) or "-",
            }
            for g in gpus
        ]
        cols = [("GPU", "index"), ("NAME", "name"), ("ACTIVE", "active_s"),
                ("INACTIVE", "inactive_s"), ("GB/S/LINK", "gbps_per_link"), ("GB/S", "total_gbps")]  # fmt: skip
        lines += ["", "NVLink links per GPU:", table(rows, cols)]
    if not devices and not gpus:
        lines.append("no NVLink link matrix in its inventory")
    return "\n".join(lines)


def machine_topology(args: argparse.Namespace, c: Client) -> None:
    emit(args, c.call("GET", f"/api/v1/machines/{args.id}/topology"), _matrix_text)
