"""``metalctl tenants`` (admin): list and create tenants, show or create a tenant's hub, print
a tenant's fabric partition for the subnet manager."""

from __future__ import annotations

import argparse
from typing import Any

from .client import Client
from .options import Subparsers
from .output import emit, emit_table, table

COLUMNS = [
    ("ID", "id"),
    ("NAME", "name"),
    ("KIND", "cluster_kind"),
    ("CONTROL PLANE", "control_plane"),
    ("OVERLAY", "overlay_prefix"),
    ("VLAN", "vlan"),
]
PEER_COLUMNS = [
    ("MACHINE", "machine_id"),
    ("ADDRESS", "address"),
    ("PUBLIC KEY", "public_key"),
    ("LAST HANDSHAKE", "last_handshake_at"),
]


def register(sub: Subparsers) -> None:
    tn = sub.add_parser("tenants", help="tenants (admin)")
    tnsub = tn.add_subparsers(dest="sub", required=True)
    tnsub.add_parser("list", help="the tenants").set_defaults(func=list_tenants)
    shw = tnsub.add_parser("show", help="one tenant")
    shw.add_argument("id", help="id, name or id prefix")
    shw.set_defaults(func=show)
    tnc = tnsub.add_parser("create", help="create a tenant")
    tnc.add_argument("name")
    tnc.add_argument("--kind", default="slurm", choices=["slurm", "kubernetes"])
    tnc.set_defaults(func=create)
    tnh = tnsub.add_parser("hub", help="show a tenant's WireGuard hub, or --create it")
    tnh.add_argument("id", help="tenant id")
    tnh.add_argument("--create", action="store_true")
    tnh.add_argument(
        "--endpoint-host", help="underlay address nodes dial (default: from tenants.hub_addresses)"
    )
    tnh.add_argument("--port", type=int, default=51820)
    tnh.set_defaults(func=hub)
    tnf = tnsub.add_parser(
        "fabric",
        help="print a tenant's InfiniBand partition as an OpenSM partitions.conf fragment "
        "(--json: VLAN, PKey and each machine's port GUIDs too)",
    )
    tnf.add_argument("id", help="tenant id")
    tnf.set_defaults(func=fabric)


def list_tenants(args: argparse.Namespace, c: Client) -> None:
    emit_table(args, c.call("GET", "/api/v1/tenants"), COLUMNS)


def create(args: argparse.Namespace, c: Client) -> None:
    t = c.call("POST", "/api/v1/tenants", {"name": args.name, "cluster_kind": args.kind})
    emit(args, t, lambda t: f"tenant {t['id']} ({t['name']}) created")


def _hub(h: dict[str, Any]) -> str:
    return (
        f"hub {h['ifname']} endpoint {h['endpoint']} address {h['address']} "
        f"overlay {h['overlay_prefix']} public key {h['public_key']}\n"
        + table(h["peers"], PEER_COLUMNS)
    )


def hub(args: argparse.Namespace, c: Client) -> None:
    if args.create:
        body: dict[str, Any] = {"listen_port": args.port}
        if args.endpoint_host:
            body["endpoint_host"] = args.endpoint_host
        h = c.call("POST", f"/api/v1/tenants/{args.id}/hub", body)
    else:
        h = c.call("GET", f"/api/v1/tenants/{args.id}/hub")
    emit(args, h, _hub)


def fabric(args: argparse.Namespace, c: Client) -> None:
    f = c.call("GET", f"/api/v1/tenants/{args.id}/fabric")
    emit(args, f, lambda f: f["partitions_conf"].rstrip("\n"))


def show(args: argparse.Namespace, c: Client) -> None:
    r = c.call("GET", f"/api/v1/tenants/{args.id}")
    emit(
        args, r, lambda r: "\n".join(f"{k + ':':15} {'' if v is None else v}" for k, v in r.items())
    )
