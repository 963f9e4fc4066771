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
    bp.add_argument("action", nargs="?", choices=["status", "on", "off", "cycle", "soft-off", "reset"], default="status")
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
    elif args.cmd == "bmcs":
        if args.sub == "power":
            if args.action == "status":
                r = c.call("GET", f"/api/v1/bmcs/{args.id}/power")
            else:
                r = c.call("POST", f"/api/v1/bmcs/{args.id}/power", {"action": args.action})
            print(json.dumps(r, indent=2) if args.json else f"bmc {args.id}: power {r.get('power_state')}")
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
