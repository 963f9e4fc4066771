"""BMC control: ``metalctl power``, ``boot-device`` and ``sensors`` on a machine, and
``metalctl bmcs`` (list, register, power a BMC's host before its machine enrolls)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from .client import Client
from .options import DISRUPTIVE_POWER, POWER_ACTIONS, Subparsers, UsageError, confirm
from .output import emit, emit_table, machine_readable

SENSOR_COLUMNS = [
    ("NAME", "name"),
    ("KIND", "kind"),
    ("VALUE", "value"),
    ("UNITS", "units"),
    ("HEALTH", "health"),
]
BMC_COLUMNS = [
    ("ID", "id"),
    ("ADDRESS", "address"),
    ("PROTOCOL", "protocol"),
    ("HEALTH", "health"),
    ("POWER", "power_state"),
    ("MACHINE", "machine_id"),
]


def register(sub: Subparsers) -> None:
    p = sub.add_parser("power", help="power state and actions through the machine's BMC")
    p.add_argument("id", help="machine id")
    p.add_argument("action", nargs="?", choices=POWER_ACTIONS, default="status")
    p.add_argument("--wait", action="store_true", help="until the BMC reports the new state")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds --wait waits at most")
    p.set_defaults(func=power)
    lp = sub.add_parser("locate", help="the machine's locate (chassis identify) light")
    lp.add_argument("id", help="machine id")
    lp.add_argument("state", nargs="?", choices=("on", "off", "status"), default="status")
    lp.set_defaults(func=locate)
    fp = sub.add_parser("firmware", help="firmware versions the machine's BMC reports")
    fp.add_argument("id", help="machine id")
    fp.set_defaults(func=firmware)
    bp2 = sub.add_parser("bios", help="BIOS settings: show, or set desired attributes")
    bp2.add_argument("id", help="machine id")
    bp2.add_argument(
        "set", nargs="*", metavar="NAME=VALUE", help="desired attributes, staged for next boot"
    )
    bp2.set_defaults(func=bios)
    b = sub.add_parser("boot-device", help="set the next boot device")
    b.add_argument("id")
    b.add_argument("device", choices=["pxe", "disk"])
    b.add_argument("--persistent", action="store_true")
    b.add_argument("--legacy", action="store_true", help="legacy BIOS instead of UEFI")
    b.set_defaults(func=boot_device)
    s = sub.add_parser("sensors", help="temperatures, fans and power draw")
    s.add_argument("id")
    s.set_defaults(func=sensors)

    bm = sub.add_parser("bmcs", help="list or register BMCs")
    bsub = bm.add_subparsers(dest="sub", required=True)
    bsub.add_parser("list").set_defaults(func=list_bmcs)
    bp = bsub.add_parser("power", help="power a BMC's host (before its machine has enrolled)")
    bp.add_argument("id", help="BMC id")
    bp.add_argument("action", nargs="?", choices=POWER_ACTIONS, default="status")
    bp.set_defaults(func=bmc_power)
    bs = bsub.add_parser("show")
    bs.add_argument("id", help="BMC id or id prefix")
    bs.set_defaults(func=show_bmc)
    bl = bsub.add_parser("link", help="link the BMC to a machine (or --unlink it)")
    bl.add_argument("id")
    bl.add_argument("machine", nargs="?", help="machine id, name or prefix")
    bl.add_argument("--unlink", action="store_true")
    bl.set_defaults(func=link_bmc)
    bx = bsub.add_parser("remove", help="forget the BMC and its stored credentials")
    bx.add_argument("id")
    bx.set_defaults(func=remove_bmc)
    lg = sub.add_parser("bmc-log", help="a machine's BMC event log")
    lg.add_argument("id")
    lg.set_defaults(func=bmc_log)
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
    br.set_defaults(func=register_bmc)


WAIT_INTERVAL_S = 1.0


def _power(c: Client, path: str, action: str, wait_s: float | None = None) -> Any:
    if action == "status":
        return c.call("GET", path)
    body: dict[str, Any] = {"action": action}
    if wait_s is not None:
        body["wait_s"] = wait_s
    return c.call("POST", path, body)


def power(args: argparse.Namespace, c: Client) -> int | None:
    if args.action in DISRUPTIVE_POWER:
        confirm(args, f"power {args.action} machine {args.id}")
    path = f"/api/v1/machines/{args.id}/power"
    # The server waits for the BMC to report the new state (up to its power_state_timeout_s);
    # --wait follows a command it answered 202 for until it is confirmed or failed.
    deadline = time.monotonic() + args.timeout
    r = _power(c, path, args.action, args.timeout if args.wait else None)
    if args.wait and r.get("status") == "pending":
        while r.get("status") == "pending":
            if time.monotonic() >= deadline:
                print(
                    f"metalctl: {args.id} did not report power {r.get('target_state')} within "
                    f"{args.timeout:g} s (command {r.get('command_id')} still pending)"
                )
                return 1
            time.sleep(WAIT_INTERVAL_S)
            r = c.call("GET", f"{path}/commands/{r['command_id']}")
    if r.get("status") == "failed":
        print(f"metalctl: {args.id}: {r.get('detail') or 'the BMC never reported the state'}")
        return 1
    emit(args, r, lambda r: f"{args.id}: power {_shown(r)}")


def _shown(r: dict[str, Any]) -> str:
    if r.get("status") == "pending":
        return (
            f"{r.get('power_state') or 'unknown'} (power {r.get('target_state')} sent, not yet "
            f"reported; follow it with --wait or command {r.get('command_id')})"
        )
    return str(r.get("power_state", r))


def locate(args: argparse.Namespace, c: Client) -> None:
    path = f"/api/v1/machines/{args.id}/locate"
    if args.state == "status":
        r = c.call("GET", path)
    else:
        r = c.call("PUT", path, {"on": args.state == "on"})
    shown = {True: "on", False: "off", None: "unknown (the BMC does not say)"}
    emit(args, r, lambda r: f"{args.id}: locate {shown[r.get('on')]}")


FIRMWARE_COLUMNS = [("ID", "id"), ("NAME", "name"), ("VERSION", "version")]


def firmware(args: argparse.Namespace, c: Client) -> None:
    emit_table(args, c.call("GET", f"/api/v1/machines/{args.id}/firmware"), FIRMWARE_COLUMNS)


def _bios_value(text: str) -> Any:
    """NAME=VALUE values as the BMC's registry types them: integers, true/false, or text."""
    if text.lstrip("-").isdigit():
        return int(text)
    return {"true": True, "false": False}.get(text, text)


def bios(args: argparse.Namespace, c: Client) -> None:
    path = f"/api/v1/machines/{args.id}/bios"
    if args.set:
        attrs: dict[str, Any] = {}
        for kv in args.set:
            name, sep, value = kv.partition("=")
            if not sep or not name:
                raise UsageError(f"write attributes as NAME=VALUE, not {kv!r}")
            attrs[name] = _bios_value(value)
        r = c.call("PUT", path, {"attributes": attrs})
    else:
        r = c.call("GET", path)

    def text(r: dict[str, Any]) -> str:
        lines = [f"{k} = {v!r}" for k, v in sorted(r.get("current", {}).items())]
        lines += [f"{k} -> {v!r} (pending, next boot)" for k, v in r.get("pending", {}).items()]
        lines += [
            f"DRIFT {k}: {d['have']!r}, want {d['want']!r}" for k, d in r.get("drift", {}).items()
        ]
        return "\n".join(lines)

    emit(args, r, text)


def boot_device(args: argparse.Namespace, c: Client) -> None:
    r = c.call(
        "PUT",
        f"/api/v1/machines/{args.id}/boot-device",
        {"device": args.device, "persistent": args.persistent, "uefi": not args.legacy},
    )
    emit(args, r, lambda _: f"{args.id}: next boot {args.device}")


def sensors(args: argparse.Namespace, c: Client) -> None:
    emit_table(args, c.call("GET", f"/api/v1/machines/{args.id}/sensors"), SENSOR_COLUMNS)


def list_bmcs(args: argparse.Namespace, c: Client) -> None:
    emit_table(args, c.call("GET", "/api/v1/bmcs"), BMC_COLUMNS)


def bmc_power(args: argparse.Namespace, c: Client) -> None:
    if args.action in DISRUPTIVE_POWER:
        confirm(args, f"power {args.action} the host of BMC {args.id}")
    r = _power(c, f"/api/v1/bmcs/{args.id}/power", args.action)
    emit(args, r, lambda r: f"bmc {args.id}: power {r.get('power_state')}")


def register_bmc(args: argparse.Namespace, c: Client) -> None:
    password = os.environ.get(args.password_env)
    if not password:
        raise UsageError(
            f"put the BMC password in ${args.password_env} (never on the command line)"
        )
    body: dict[str, Any] = {
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
    emit(args, r, lambda r: f"bmc {r['id']} registered ({r['protocol']}, {r['health']})")


def show_bmc(args: argparse.Namespace, c: Client) -> None:
    b = c.call("GET", f"/api/v1/bmcs/{args.id}")
    emit(
        args, b, lambda b: "\n".join(f"{k + ':':15} {'' if v is None else v}" for k, v in b.items())
    )


def link_bmc(args: argparse.Namespace, c: Client) -> None:
    if bool(args.machine) == args.unlink:
        raise UsageError("name a machine to link, or --unlink (not both)")
    machine = None if args.unlink else c.call("GET", f"/api/v1/machines/{args.machine}")["id"]
    b = c.call("PUT", f"/api/v1/bmcs/{args.id}/machine", {"machine_id": machine})
    emit(args, b, lambda b: f"bmc {b['id']}: machine {b['machine_id'] or '-'}")


def remove_bmc(args: argparse.Namespace, c: Client) -> None:
    confirm(args, f"remove BMC {args.id} and its stored credentials")
    c.call("DELETE", f"/api/v1/bmcs/{args.id}")
    if not machine_readable(args):
        print(f"bmc {args.id} removed")


def bmc_log(args: argparse.Namespace, c: Client) -> None:
    r = c.call("GET", f"/api/v1/machines/{args.id}/bmc-log")
    emit(args, r, lambda r: "\n".join(json.dumps(e) for e in r.get("items", [])))
