"""``metalctl machines``: list, show, register, label, and the technician's actions."""

from __future__ import annotations

import argparse
from typing import Any

from . import commissioning
from .client import Client
from .options import Subparsers, confirm, key_values
from .output import emit, table

COLUMNS = [
    ("ID", "id"),
    ("NAME", "name"),
    ("STATE", "state"),
    ("GPUS", "gpus"),
    ("MEM_GB", "mem"),
    ("RACK", "rack"),
    ("LABELS", "labels_s"),
    ("TENANT", "tenant_id"),
]
SHOW_FIELDS = (
    "id",
    "name",
    "state",
    "version",
    "rack",
    "rack_position",
    "firmware",
    "vendor",
    "product",
    "serial",
    "system_uuid",
    "cpu_model",
    "cpu_count",
    "memory_mb",
    "gpu_model",
    "gpu_count",
    "power_state",
    "tenant_id",
    "last_error",
)
ACTIONS = ("inspect", "maintenance-on", "maintenance-off", "mark-broken", "repair", "retire")
LIST_FILTERS = ("gpu_model", "gpu_count", "min_gpu_count", "rack", "limit", "offset")


def register(sub: Subparsers) -> None:
    m = sub.add_parser("machines", help="list, show, register, label and act on machines")
    msub = m.add_subparsers(dest="sub", required=True)
    ml = msub.add_parser("list")
    ml.add_argument("--state", action="append", default=[])
    ml.add_argument("--label", action="append", default=[], help="key=value")
    ml.add_argument("--gpu-model", dest="gpu_model")
    ml.add_argument("--gpu-count", dest="gpu_count", type=int)
    ml.add_argument("--min-gpu-count", dest="min_gpu_count", type=int)
    ml.add_argument("--rack")
    ml.add_argument("--limit", type=int)
    ml.add_argument("--offset", type=int)
    ml.set_defaults(func=list_machines)
    ms = msub.add_parser("show")
    ms.add_argument("id")
    ms.set_defaults(func=show)
    mr = msub.add_parser("register")
    mr.add_argument("--mac", action="append", required=True)
    mr.add_argument("--name")
    mr.add_argument("--label", action="append", default=[])
    mr.set_defaults(func=register_machine)
    mlab = msub.add_parser("label", help="key=value sets, key- removes")
    mlab.add_argument("id")
    mlab.add_argument("labels", nargs="+")
    mlab.set_defaults(func=label)
    for action in ACTIONS:
        pa = msub.add_parser(action)
        pa.add_argument("id", help="id, name or id prefix")
        pa.add_argument("--reason", required=action == "retire")
        pa.set_defaults(func=act)
    for step, needs_reason in (("retry", False), ("wipe", False), ("confirm-wipe", True)):
        ps = msub.add_parser(step)
        ps.add_argument("id", help="id, name or id prefix")
        ps.add_argument("--reason", required=needs_reason)
        ps.set_defaults(func=workflow_step)
    jt = msub.add_parser("join-token", help="a one-time token for the node to join its tenant")
    jt.add_argument("id")
    jt.add_argument("--ttl", type=int, default=1800, help="seconds it stays valid (60-86400)")
    jt.set_defaults(func=join_token)
    mp = msub.add_parser("peer-revoke", help="take the machine off its tenant's hub")
    mp.add_argument("id")
    mp.set_defaults(func=revoke_peer)
    mn = msub.add_parser("rename", help="give a machine a new (unique) name")
    mn.add_argument("id")
    mn.add_argument("name")
    mn.set_defaults(func=rename)
    commissioning.register(msub)


def row(m: dict[str, Any]) -> dict[str, Any]:
    r = dict(m)
    r["gpus"] = f"{m['gpu_count']}x {m['gpu_model']}" if m.get("gpu_count") else "-"
    r["mem"] = round(m["memory_mb"] / 1024) if m.get("memory_mb") else None
    r["labels_s"] = ",".join(f"{k}={v}" for k, v in sorted((m.get("labels") or {}).items()))
    return r


def list_machines(args: argparse.Namespace, c: Client) -> None:
    q = [("state", s) for s in args.state] + [("label", lb) for lb in args.label]
    for key in LIST_FILTERS:
        if getattr(args, key) is not None:
            q.append((key, str(getattr(args, key))))
    page = c.call("GET", "/api/v1/machines", query=q)
    emit(
        args,
        page,
        lambda p: (
            table([row(m) for m in p["items"]], COLUMNS) + f"\n({len(p['items'])} of {p['total']})"
        ),
    )


def _details(m: dict[str, Any]) -> str:
    lines = [f"{k + ':':15} {'' if m.get(k) is None else m[k]}" for k in SHOW_FIELDS]
    labels = ", ".join(f"{k}={v}" for k, v in sorted(m["labels"].items()))
    nics = ", ".join(n["mac"] + (" (pxe)" if n["pxe"] else "") for n in m["nics"])
    lines += [
        f"{'labels:':15} {labels}",
        f"{'nics:':15} {nics}",
        f"{'actions:':15} {', '.join(m['allowed_actions'])}",
    ]
    return "\n".join(lines)


def show(args: argparse.Namespace, c: Client) -> None:
    emit(args, c.call("GET", f"/api/v1/machines/{args.id}"), _details)


def register_machine(args: argparse.Namespace, c: Client) -> None:
    body: dict[str, Any] = {"macs": args.mac}
    if args.name:
        body["name"] = args.name
    if args.label:
        body["labels"] = key_values(args.label)
    m = c.call("POST", "/api/v1/machines", body)
    emit(args, m, lambda m: f"registered {m['id']} ({m['state']})")


def label(args: argparse.Namespace, c: Client) -> None:
    m = c.call("PATCH", f"/api/v1/machines/{args.id}/labels", {"labels": key_values(args.labels)})
    emit(args, m, lambda m: f"{m['id']}: {m['labels']}")


def workflow_step(args: argparse.Namespace, c: Client) -> None:
    if args.sub in ("wipe", "confirm-wipe"):
        confirm(args, f"{args.sub} machine {args.id} (its disks are erased or declared erased)")
    body = {"reason": args.reason} if args.reason else {}
    m = c.call("POST", f"/api/v1/machines/{args.id}/{args.sub}", body)
    emit(args, m, lambda m: f"{m['name'] or m['id']}: {m['state']}")


def join_token(args: argparse.Namespace, c: Client) -> None:
    t = c.call("POST", f"/api/v1/machines/{args.id}/join-token", {"ttl_seconds": args.ttl})
    emit(args, t, lambda t: f"{t['token']}\n(valid until {t['expires_at']}; shown only now)")


def revoke_peer(args: argparse.Namespace, c: Client) -> None:
    confirm(args, f"take machine {args.id} off its tenant's hub")
    p = c.call("DELETE", f"/api/v1/machines/{args.id}/peer")
    emit(args, p, lambda p: f"{args.id}: off the hub")


def rename(args: argparse.Namespace, c: Client) -> None:
    m = c.call("PATCH", f"/api/v1/machines/{args.id}", {"name": args.name})
    emit(args, m, lambda m: f"{m['id']}: named {m['name']}")


def act(args: argparse.Namespace, c: Client) -> None:
    if args.sub == "retire":
        confirm(args, f"retire machine {args.id} (it never boots from metald again)")
    body = {"action": args.sub}
    if args.reason:
        body["reason"] = args.reason
    m = c.call("POST", f"/api/v1/machines/{args.id}/actions", body)
    emit(args, m, lambda m: f"{m['id']}: {m['state']}")
