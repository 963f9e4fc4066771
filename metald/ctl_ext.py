"""metalctl commands for BMC control: power, boot device, sensors, BMC registration."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_extension_parsers(sub: Any) -> None:
    p = sub.add_parser("power", help="power state and actions through the machine's BMC")
    p.add_argument("id", help="machine id")
    p.add_argument(
        "action",
        nargs="?",
        choices=["status", "on", "off", "cycle", "soft-off", "reset"],
        default="status",
    )
    b = sub.add_parser("boot-device", help="set the next boot device")
    b.add_argument("id")
    b.add_argument("device", choices=["pxe", "disk"])
    b.add_argument("--persistent", action="store_true")
    b.add_argument("--legacy", action="store_true", help="legacy BIOS instead of UEFI")
    s = sub.add_parser("sensors", help="temperatures, fans and power draw")
    s.add_argument("id")
    bm = sub.add_parser("bmcs", help="list or register BMCs")
    bsub = bm.add_subparsers(dest="sub", required=True)
    bsub.add_parser("list")
    bp = bsub.add_parser("power", help="power a BMC's host (before its machine has enrolled)")
    bp.add_argument("id", help="BMC id")
    bp.add_argument(
        "action",
        nargs="?",
        choices=["status", "on", "off", "cycle", "soft-off", "reset"],
        default="status",
    )
    br = bsub.add_parser("register")
    br.add_argument("address")
    br.add_argument("--port", type=int)
    br.add_argument("--protocol", default="auto", choices=["auto", "ipmi", "redfish"])
    br.add_argument("--username", required=True)
    br.add_argument("--password-env", default="BMC_PASSWORD", help="env var holding the password")
    br.add_argument("--machine")
    br.add_argument(
        "--insecure", action="store_true", help="do not verify the BMC's TLS certificate"
    )

    im = sub.add_parser("images", help="images machines are provisioned with")
    isub = im.add_subparsers(dest="sub", required=True)
    isub.add_parser("list")
    ic = isub.add_parser("create")
    ic.add_argument("name")
    ic.add_argument("--kind", choices=["disk", "stateless"], default="disk")
    # dest differs from metalctl's own --url (the API's address), which it would overwrite.
    ic.add_argument("--url", dest="image_url", help="disk: http(s) URL of the raw image")
    ic.add_argument("--sha256")
    ic.add_argument("--size", type=int, dest="size_bytes")
    ic.add_argument("--kernel")
    ic.add_argument("--initrd")
    ic.add_argument("--rootfs")
    cl = sub.add_parser("claims", help="claim machines for a tenant, watch, release")
    csub = cl.add_subparsers(dest="sub", required=True)
    csub.add_parser("list")
    cc = csub.add_parser("create")
    cc.add_argument("--tenant", required=True, help="tenant id")
    cc.add_argument("--count", type=int, required=True)
    cc.add_argument("--image", required=True, help="image id")
    cc.add_argument("--gpu-model")
    cc.add_argument("--min-gpus", type=int, default=0)
    cc.add_argument("--min-memory-mb", type=int)
    cc.add_argument("--label", action="append", default=[], help="key=value")
    cc.add_argument("--rack")
    cc.add_argument("--ssh-key", action="append", default=[])
    cc.add_argument("--idempotency-key")
    cs = csub.add_parser("show")
    cs.add_argument("id")
    cs.add_argument(
        "--watch", action="store_true", help="redraw progress until every machine settles"
    )
    cr = csub.add_parser("release")
    cr.add_argument("id")
    cr.add_argument("--machine", help="release only this machine of the claim (scale down)")


SETTLED = {"provisioned", "active", "ready", "provision-failed", "wipe-failed", "join-failed"}


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


def _claim_table(claim: dict[str, Any]) -> str:
    from metald.ctl import table

    rows = [dict(m, bar=progress_bar(m.get("progress"))) for m in claim["machines"]]
    head = f"claim {claim['id']} tenant {claim['tenant_id']} {claim['state']} ({claim['count']} machines)"
    return (
        head
        + "\n"
        + table(
            rows,
            [("MACHINE", "id"), ("STATE", "state"), ("PROGRESS", "bar"), ("ERROR", "last_error")],
        )
    )


def run_extension(args: argparse.Namespace, c: Any) -> int:
    import os

    from metald.ctl import table

    if args.cmd == "power":
        if args.action == "status":
            r = c.call("GET", f"/api/v1/machines/{args.id}/power")
        else:
            r = c.call("POST", f"/api/v1/machines/{args.id}/power", {"action": args.action})
        print(
            json.dumps(r, indent=2) if args.json else f"{args.id}: power {r.get('power_state', r)}"
        )
    elif args.cmd == "boot-device":
        r = c.call(
            "PUT",
            f"/api/v1/machines/{args.id}/boot-device",
            {"device": args.device, "persistent": args.persistent, "uefi": not args.legacy},
        )
        print(json.dumps(r, indent=2) if args.json else f"{args.id}: next boot {args.device}")
    elif args.cmd == "sensors":
        r = c.call("GET", f"/api/v1/machines/{args.id}/sensors")
        print(
            json.dumps(r, indent=2)
            if args.json
            else table(
                r.get("items", []),
                [
                    ("NAME", "name"),
                    ("KIND", "kind"),
                    ("VALUE", "value"),
                    ("UNITS", "units"),
                    ("HEALTH", "health"),
                ],
            )
        )
    elif args.cmd == "images":
        if args.sub == "list":
            r = c.call("GET", "/api/v1/images")
            print(
                json.dumps(r, indent=2)
                if args.json
                else table(r["items"], [("ID", "id"), ("NAME", "name"), ("KIND", "kind")])
            )
        else:
            body = {
                k: getattr(args, k)
                for k in (
                    "name",
                    "kind",
                    "sha256",
                    "size_bytes",
                    "kernel",
                    "initrd",
                    "rootfs",
                )
                if getattr(args, k) is not None
            }
            if args.image_url:
                body["url"] = args.image_url
            r = c.call("POST", "/api/v1/images", body)
            print(
                json.dumps(r, indent=2) if args.json else f"image {r['id']} ({r['name']}) created"
            )
    elif args.cmd == "claims":
        if args.sub == "list":
            r = c.call("GET", "/api/v1/claims")
            print(
                json.dumps(r, indent=2)
                if args.json
                else table(
                    r["items"],
                    [
                        ("ID", "id"),
                        ("TENANT", "tenant_id"),
                        ("COUNT", "count"),
                        ("STATE", "state"),
                        ("CREATED", "created_at"),
                    ],
                )
            )
        elif args.sub == "create":
            from metald.ctl import _kv

            selector: dict[str, Any] = {"min_gpu_count": args.min_gpus, "labels": _kv(args.label)}
            if args.gpu_model:
                selector["gpu_model"] = args.gpu_model
            if args.min_memory_mb:
                selector["min_memory_mb"] = args.min_memory_mb
            if args.rack:
                selector["rack"] = args.rack
            body = {
                "tenant_id": args.tenant,
                "count": args.count,
                "image_id": args.image,
                "selector": selector,
                "ssh_authorized_keys": args.ssh_key,
            }
            if args.idempotency_key:
                body["idempotency_key"] = args.idempotency_key
            r = c.call("POST", "/api/v1/claims", body)
            print(json.dumps(r, indent=2) if args.json else _claim_table(r))
        elif args.sub == "show":
            import time

            while True:
                r = c.call("GET", f"/api/v1/claims/{args.id}")
                if args.json:
                    print(json.dumps(r, indent=2))
                    break
                print(_claim_table(r), flush=True)
                if not args.watch or all(m["state"] in SETTLED for m in r["machines"]):
                    break
                time.sleep(2)
                print(flush=True)
        else:
            path = f"/api/v1/claims/{args.id}/release"
            if args.machine:
                path = f"/api/v1/claims/{args.id}/machines/{args.machine}/release"
            r = c.call("POST", path)
            print(json.dumps(r, indent=2) if args.json else _claim_table(r))
    elif args.cmd == "bmcs":
        if args.sub == "power":
            if args.action == "status":
                r = c.call("GET", f"/api/v1/bmcs/{args.id}/power")
            else:
                r = c.call("POST", f"/api/v1/bmcs/{args.id}/power", {"action": args.action})
            print(
                json.dumps(r, indent=2)
                if args.json
                else f"bmc {args.id}: power {r.get('power_state')}"
            )
        elif args.sub == "list":
            r = c.call("GET", "/api/v1/bmcs")
            print(
                json.dumps(r, indent=2)
                if args.json
                else table(
                    r.get("items", []),
                    [
                        ("ID", "id"),
                        ("ADDRESS", "address"),
                        ("PROTOCOL", "protocol"),
                        ("HEALTH", "health"),
                        ("POWER", "power_state"),
                        ("MACHINE", "machine_id"),
                    ],
                )
            )
        else:
            password = os.environ.get(args.password_env)
            if not password:
                raise SystemExit(
                    f"metalctl: put the BMC password in ${args.password_env} (never on the command line)"
                )
            body = {
                "address": args.address,
                "protocol": args.protocol,
                "username": args.username,
                "password": password,
                "verify_tls": not args.insecure,
            }
            if args.port:
                body["port"] = args.port
            if args.machine:
                body["machine_id"] = args.machine
            r = c.call("POST", "/api/v1/bmcs", body)
            print(
                json.dumps(r, indent=2)
                if args.json
                else f"bmc {r['id']} registered ({r['protocol']}, {r['health']})"
            )
    return 0
