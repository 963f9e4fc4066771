"""``metalctl claims``: claim machines for a tenant, watch their progress, release them."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import yaml

from metald.lifecycle import SETTLED

from . import topology
from .client import Client
from .names import image_names, shown, tenant_names
from .options import Subparsers, confirm, key_values
from .output import emit, emit_table, machine_readable, render, table
from .progress import Progress

COLUMNS = [
    ("ID", "id"),
    ("TENANT", "tenant"),
    ("IMAGE", "image"),
    ("COUNT", "count"),
    ("STATE", "state"),
    ("CREATED", "created_at"),
]
MACHINE_COLUMNS = [
    ("MACHINE", "label"),
    ("STATE", "state"),
    ("PROGRESS", "bar"),
    ("ERROR", "last_error"),
]
WATCH_INTERVAL_S = 2


def register(sub: Subparsers) -> None:
    cl = sub.add_parser("claims", help="claim machines for a tenant, watch, release")
    csub = cl.add_subparsers(dest="sub", required=True)
    csub.add_parser("list", help="the claims and their state").set_defaults(func=list_claims)
    cc = csub.add_parser("create", help="claim machines for a tenant, provisioned with an image")
    cc.add_argument("--tenant", required=True, help="tenant name or id")
    cc.add_argument("--count", type=int, required=True)
    cc.add_argument("--image", required=True, help="image name or id")
    cc.add_argument("--gpu-model")
    cc.add_argument("--min-gpus", type=int, default=0)
    cc.add_argument("--min-memory-mb", type=int)
    cc.add_argument("--label", action="append", default=[], help="key=value")
    cc.add_argument("--rack")
    cc.add_argument(
        "--pack",
        choices=["nvlink-domain", "rack", "ib-leaf"],
        help="every group of machines in one NVLink domain, rack or InfiniBand leaf",
    )
    cc.add_argument("--group-size", type=int, help="machines per packed group (default: all)")
    cc.add_argument(
        "--spread", choices=["power-domain"], help="spread the machines over power domains"
    )
    cc.add_argument(
        "--arch", choices=("amd64", "arm64"), help="CPU architecture (default: the image's)"
    )
    cc.add_argument(
        "--secure-boot",
        action="store_true",
        help="only machines whose firmware enforces UEFI Secure Boot (the BMC's word)",
    )
    cc.add_argument(
        "--attested",
        action="store_true",
        help="only machines whose current boot passed measured-boot attestation",
    )
    cc.add_argument("--ssh-key", action="append", default=[])
    cc.add_argument("--idempotency-key")
    cc.add_argument(
        "--user-data", metavar="FILE", help="cloud-init user-data for every machine (any form)"
    )
    cc.add_argument("--network", metavar="FILE", help="network request, JSON or YAML")
    cc.add_argument("--storage", metavar="FILE", help="storage layout, JSON or YAML")
    cc.add_argument(
        "--wait", action="store_true", help="then redraw progress until every machine settles"
    )
    cc.set_defaults(func=create)
    cs = csub.add_parser("show", help="one claim: its machines and their progress")
    cs.add_argument("id")
    cs.add_argument(
        "--watch",
        "--wait",
        action="store_true",
        help="redraw progress until every machine settles",
    )
    cs.set_defaults(func=show)
    ct = csub.add_parser(
        "topology", help="a claim's Slurm topology.conf (tree or block) or IMEX nodes_config"
    )
    ct.add_argument("id")
    ct.add_argument("what", nargs="?", default="tree", choices=["tree", "block", "imex"])
    ct.set_defaults(func=topology.claim_topology)
    cr = csub.add_parser("release", help="release a claim: its machines are wiped and freed")
    cr.add_argument("id")
    cr.add_argument("--machine", help="release only this machine of the claim (scale down)")
    cr.set_defaults(func=release)
    fc = csub.add_parser(
        "firmware-consent",
        help="consent (on) or not (off) to this claim's machines being drained for firmware "
        "rollouts",
    )
    fc.add_argument("id")
    fc.add_argument("consent", choices=("on", "off"))
    fc.set_defaults(func=firmware_consent)


def progress_bar(p: dict[str, Any] | None, width: int = 24) -> str:
    if not p:
        return ""
    if p.get("error"):
        return f"error: {p['error']}"
    pct = p.get("percent")
    rate = f" {p['rate_bps'] / 1e6:.1f} MB/s" if p.get("rate_bps") else ""
    if pct is None:
        return f"{p.get('phase') or ''} {p.get('bytes') or 0} bytes{rate}"
    filled = int(width * pct / 100)
    return f"{p.get('phase') or ''} [{'#' * filled}{'.' * (width - filled)}] {pct:5.1f}%{rate}"


def claim_table(claim: dict[str, Any]) -> str:
    rows = [
        dict(m, label=m.get("name") or m["id"][:8], bar=progress_bar(m.get("progress")))
        for m in claim["machines"]
    ]
    head = f"claim {claim['id']} tenant {claim['tenant_id']} {claim['state']} ({claim['count']} machines)"
    return head + "\n" + table(rows, MACHINE_COLUMNS)


def list_claims(args: argparse.Namespace, c: Client) -> None:
    page = c.call("GET", "/api/v1/claims")
    tenants = tenant_names(c, (x["tenant_id"] for x in page["items"]))
    images = image_names(c, (x.get("image_id") for x in page["items"]))
    emit_table(
        args,
        page,
        COLUMNS,
        row=lambda x: dict(
            x, tenant=shown(tenants, x["tenant_id"]), image=shown(images, x.get("image_id"))
        ),
    )


def create(args: argparse.Namespace, c: Client) -> None:
    selector: dict[str, Any] = {"min_gpu_count": args.min_gpus, "labels": key_values(args.label)}
    if args.gpu_model:
        selector["gpu_model"] = args.gpu_model
    if args.min_memory_mb:
        selector["min_memory_mb"] = args.min_memory_mb
    if args.rack:
        selector["rack"] = args.rack
    if args.arch:
        selector["arch"] = args.arch
    if args.secure_boot:
        selector["secure_boot"] = True
    if args.attested:
        selector["attested"] = True
    # Names or id prefixes, as everywhere; the claim body takes ids.
    tenant = c.call("GET", f"/api/v1/tenants/{args.tenant}")["id"]
    image = c.call("GET", f"/api/v1/images/{args.image}")["id"]
    body = {
        "tenant_id": tenant,
        "count": args.count,
        "image_id": image,
        "selector": selector,
        "ssh_authorized_keys": args.ssh_key,
    }
    if args.idempotency_key:
        body["idempotency_key"] = args.idempotency_key
    if args.user_data:
        body["user_data"] = Path(args.user_data).read_text()
    for field in ("network", "storage"):
        if getattr(args, field):
            body[field] = yaml.safe_load(Path(getattr(args, field)).read_text())
    if args.pack or args.spread:
        body["placement"] = {
            k: v
            for k, v in (
                ("pack", args.pack), ("spread", args.spread), ("group_size", args.group_size)
            )
            if v is not None
        }  # fmt: skip
    claim = c.call("POST", "/api/v1/claims", body)
    if not args.wait:
        emit(args, claim, claim_table)
        return
    args.id, args.watch = claim["id"], True
    show(args, c)


def show(args: argparse.Namespace, c: Client) -> None:
    """The claim; with --watch, redrawn in place on a terminal (a new frame only when
    something changed, elsewhere) until every machine settles."""
    frames = Progress()
    while True:
        r = c.call("GET", f"/api/v1/claims/{args.id}")
        if machine_readable(args):
            print(render(args, r))
            return
        frames.show(claim_table(r))
        if not args.watch or all(m["state"] in SETTLED for m in r["machines"]):
            return
        time.sleep(WATCH_INTERVAL_S)


def firmware_consent(args: argparse.Namespace, c: Client) -> None:
    body = {"consent": args.consent == "on"}
    emit(args, c.call("PUT", f"/api/v1/claims/{args.id}/firmware-consent", body), claim_table)


def release(args: argparse.Namespace, c: Client) -> None:
    what = f"machine {args.machine} of claim {args.id}" if args.machine else f"claim {args.id}"
    confirm(args, f"release {what} (its machines are wiped)")
    path = f"/api/v1/claims/{args.id}/release"
    if args.machine:
        path = f"/api/v1/claims/{args.id}/machines/{args.machine}/release"
    emit(args, c.call("POST", path), claim_table)
