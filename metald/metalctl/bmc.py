"""BMC control: ``metalctl power``, ``boot-device`` and ``sensors`` on a machine, and
``metalctl bmcs`` (list, register, power a BMC's host before its machine enrolls)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from . import bmcimport, bulk
from .client import ApiError, Client
from .names import machine_names, shown
from .options import (
    DISRUPTIVE_POWER,
    POWER_ACTIONS,
    Subparsers,
    UsageError,
    confirm,
    machine_ref,
)
from .output import emit, emit_table, machine_readable
from .progress import Progress

SENSOR_COLUMNS = [
    ("NAME", "name"),
    ("KIND", "kind"),
    ("VALUE", "value"),
    ("UNITS", "units"),
    ("HEALTH", "health"),
]
BMC_COLUMNS = [
    ("ADDRESS", "address"),
    ("MACHINE", "machine"),
    ("PROTOCOL", "protocol"),
    ("HEALTH", "health"),
    ("POWER", "power_state"),
    ("ID", "short_id"),
]
IMPORT_COLUMNS = [
    ("LINE", "line"),
    ("ADDRESS", "address"),
    ("MACHINE", "machine"),
    ("RESULT", "result"),
    ("DETAIL", "detail"),
]


def register(sub: Subparsers) -> None:
    p = sub.add_parser("power", help="power state and actions through the machine's BMC")
    machine_ref(p.add_argument("id", help="machine id, name or id prefix"))
    p.add_argument("action", nargs="?", choices=POWER_ACTIONS, default="status")
    p.add_argument("--wait", action="store_true", help="until the BMC reports the new state")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds --wait waits at most")
    p.set_defaults(func=power)
    lp = sub.add_parser("locate", help="the machine's locate (chassis identify) light")
    machine_ref(lp.add_argument("id", help="machine id, name or id prefix"))
    lp.add_argument("state", nargs="?", choices=("on", "off", "status"), default="status")
    lp.set_defaults(func=locate)
    bp2 = sub.add_parser("bios", help="BIOS settings: show, or set desired attributes")
    machine_ref(bp2.add_argument("id", help="machine id, name or id prefix"))
    bp2.add_argument(
        "set", nargs="*", metavar="NAME=VALUE", help="desired attributes, staged for next boot"
    )
    bp2.set_defaults(func=bios)
    b = sub.add_parser("boot-device", help="set the next boot device")
    machine_ref(b.add_argument("id", help="machine id, name or id prefix"))
    b.add_argument("device", choices=["pxe", "disk"])
    b.add_argument("--persistent", action="store_true")
    b.add_argument("--legacy", action="store_true", help="legacy BIOS instead of UEFI")
    b.set_defaults(func=boot_device)
    s = sub.add_parser("sensors", help="temperatures, fans and power draw")
    machine_ref(s.add_argument("id", help="machine id, name or id prefix"))
    s.set_defaults(func=sensors)

    bm = sub.add_parser("bmcs", help="list or register BMCs")
    bsub = bm.add_subparsers(dest="sub", required=True)
    bsub.add_parser("list", help="the BMCs, their health and machines").set_defaults(func=list_bmcs)
    bp = bsub.add_parser("power", help="power a BMC's host (before its machine has enrolled)")
    bp.add_argument("id", help="BMC id")
    bp.add_argument("action", nargs="?", choices=POWER_ACTIONS, default="status")
    bp.set_defaults(func=bmc_power)
    bs = bsub.add_parser("show", help="one BMC: address, health, capabilities")
    bs.add_argument("id", help="BMC id or id prefix")
    bs.set_defaults(func=show_bmc)
    bl = bsub.add_parser("link", help="link the BMC to a machine (or --unlink it)")
    bl.add_argument("id")
    machine_ref(bl.add_argument("machine", nargs="?", help="machine id, name or prefix"))
    bl.add_argument("--unlink", action="store_true")
    bl.set_defaults(func=link_bmc)
    bx = bsub.add_parser("remove", help="forget the BMC and its stored credentials")
    bx.add_argument("id")
    bx.set_defaults(func=remove_bmc)
    lg = sub.add_parser("bmc-log", help="a machine's BMC event log")
    machine_ref(lg.add_argument("id", help="machine id, name or id prefix"))
    lg.set_defaults(func=bmc_log)
    bi = bsub.add_parser(
        "import",
        help="register a rack's BMCs from a CSV file (address,protocol,username,password-env,"
        "machine); every row is checked first and nothing is imported if one is bad",
        # The command's own --help says how to write the file, not only the list of commands.
        description="Register a rack's BMCs from a CSV file with a header line naming its "
        "columns: address,username,password-env and optionally protocol (auto, ipmi, redfish), "
        "port, machine (id, name or prefix) and insecure (true: skip TLS checks). password-env "
        "names "
        f"the variable holding that BMC's password (e.g. {bmcimport.PASSWORD_PREFIX}RACK07); "
        "the file never holds passwords. Every row is checked first, and nothing is imported "
        "if one is bad or a BMC does not answer (see --partial, --no-verify).",
    )
    bi.add_argument("file", help="the CSV file ('-': standard input)")
    bi.add_argument("--partial", action="store_true", help="import the good rows anyway")
    bi.add_argument("--dry-run", action="store_true", help="check the file, register nothing")
    bi.add_argument(
        "--no-verify",
        action="store_true",
        help="store the BMCs without connecting (a rack not cabled yet: unreachable until its "
        "owning instance hears from each); every row then names its protocol",
    )
    bi.add_argument(
        "--allow-env",
        action="append",
        default=[],
        metavar="NAME",
        help="a variable the file's password-env column may name (repeatable); without it only "
        f"{bmcimport.PASSWORD_PREFIX}* variables are read, and METALD_TOKEN never",
    )
    bi.set_defaults(func=import_bmcs)
    br = bsub.add_parser("register", help="register a BMC (checked unless --no-verify)")
    br.add_argument("address")
    br.add_argument("--port", type=int)
    br.add_argument("--protocol", default="auto", choices=["auto", "ipmi", "redfish"])
    br.add_argument("--username", required=True)
    br.add_argument(
        "--password-env",
        default="BMC_PASSWORD",
        help="env var holding the password (not a METALD_* one other than "
        f"{bmcimport.PASSWORD_PREFIX}*)",
    )
    br.add_argument("--machine")
    br.add_argument(
        "--insecure", action="store_true", help="do not verify the BMC's TLS certificate"
    )
    br.add_argument(
        "--no-verify",
        action="store_true",
        help="store it without connecting (stored unreachable, verified once it answers); "
        "needs --protocol ipmi or redfish",
    )
    br.set_defaults(func=register_bmc)


WAIT_FOR = {"on": "on", "off": "off", "soft-off": "off", "cycle": "on", "reset": "on"}
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

    return None


def wait_power(
    c: Client, states: dict[str, str | None], want: str, timeout: float
) -> dict[str, str | None]:
    """Poll each machine's power (keyed by the reference used in its path) until all report
    ``want`` or ``timeout`` passes; progress redrawn in place on a terminal. The last states."""
    frames = Progress(sys.stderr)
    started = time.monotonic()
    deadline = started + timeout
    while True:
        pending = [ref for ref, s in states.items() if s != want]
        done = len(states) - len(pending)
        elapsed = time.monotonic() - started
        if len(states) == 1:
            ((ref, state),) = states.items()
            frames.show(f"{ref}: power {state or '?'}, waiting for {want} ({elapsed:.0f} s)")
        else:
            frames.show(
                f"power {want}: {done}/{len(states)} done ({elapsed:.0f} s)"
                + "".join(f"\n  {ref}: {states[ref] or '?'}" for ref in pending[:10])
            )
        if not pending or time.monotonic() >= deadline:
            return states
        time.sleep(WAIT_INTERVAL_S)
        for ref in pending:
            try:
                states[ref] = c.call("GET", f"/api/v1/machines/{ref}/power").get("power_state")
            except ApiError:
                states[ref] = None


def power_many(args: argparse.Namespace, c: Client) -> int:
    """``metalctl machines power ACTION (NAMES... | --selector k=v)``: one confirmation for
    the lot when disruptive, a result line per machine, exit 1 if any failed."""
    machines = bulk.select(c, args.id, args.selector)
    if args.action in DISRUPTIVE_POWER:
        bulk.confirm_many(args, f"power {args.action}", machines)
    want = WAIT_FOR.get(args.action) if args.wait else None
    reached: dict[str, str | None] = {}

    def one(m: dict[str, Any]) -> str:
        state = _power(c, f"/api/v1/machines/{m['id']}/power", args.action).get("power_state")
        reached[m["id"]] = state
        return f"power {state}"

    if want is None:
        return bulk.run_each(args, machines, one)
    # Send every command first, then wait for them together; a machine that never gets
    # there is a failure of its own line.
    sent = {m["id"]: m for m in machines}
    errors: dict[str, ApiError] = {}
    for m in machines:
        try:
            one(m)
        except ApiError as e:
            errors[m["id"]] = e
    states = wait_power(c, {i: reached[i] for i in reached}, want, args.timeout)

    def outcome(m: dict[str, Any]) -> str:
        if m["id"] in errors:
            raise errors[m["id"]]
        if states.get(m["id"]) != want:
            raise bulk.Failed(f"still power {states.get(m['id'])} after {args.timeout:g} s")
        return f"power {want}"

    return bulk.run_each(args, list(sent.values()), outcome)


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
    page = c.call("GET", "/api/v1/bmcs")
    names = machine_names(c) if any(b.get("machine_id") for b in page["items"]) else {}

    def row(b: dict[str, Any]) -> dict[str, Any]:
        mid = b.get("machine_id")
        return dict(b, short_id=b["id"][:8], machine=shown(names, mid))

    emit_table(
        args, page, BMC_COLUMNS, row=row, footer=lambda p: f"({len(p['items'])} of {p['total']})"
    )


def import_bmcs(args: argparse.Namespace, c: Client) -> int:
    """Check every row (fields, password variables, machines, addresses already registered)
    and report every bad one by line; then register the rows. A row the API refuses (an
    unreachable BMC, wrong credentials) undoes this run's registrations unless --partial."""
    if args.file == "-":
        text = sys.stdin.read()
    else:
        try:
            with open(args.file, encoding="utf-8-sig") as f:
                text = f.read()
        except OSError as e:
            raise UsageError(f"cannot read {args.file}: {e.strerror}") from None
    for name in args.allow_env:
        if refusal := bmcimport.password_env_refusal(name):
            raise UsageError(f"--allow-env {name}: {refusal}")
    parsed = bmcimport.parse(text, os.environ, frozenset(args.allow_env))
    errors = dict(parsed.errors)
    registered = {(b["address"].lower(), b.get("port")) for b in c.iterate("/api/v1/bmcs")}
    machine_ids: dict[int, str | None] = {}
    good: list[bmcimport.Row] = []
    for r in parsed.rows:
        if (r.address.lower(), r.port) in registered:
            errors[r.line] = f"a BMC at {r.address} is already registered (bmcs show/remove)"
            continue
        if r.machine:
            try:
                machine_ids[r.line] = c.call("GET", f"/api/v1/machines/{r.machine}")["id"]
            except ApiError as e:
                errors[r.line] = f"machine {r.machine}: {e.detail}"
                continue
        good.append(r)
    for line in sorted(errors):
        print(f"{args.file}:{line}: {errors[line]}", file=sys.stderr)
    if errors and not args.partial:
        raise UsageError(
            f"{len(errors)} bad row(s); nothing was imported (fix them, or --partial to import "
            "the good rows)"
        )
    if args.dry_run:
        print(f"{len(good)} row(s) would be imported, {len(errors)} skipped")
        return 1 if errors else 0
    results: list[dict[str, Any]] = []
    created: list[str] = []
    failed = False
    for i, r in enumerate(good):
        out = {"line": r.line, "address": r.address, "machine": r.machine or "-"}
        body = r.body(os.environ[r.password_env], machine_ids.get(r.line))
        if args.no_verify:
            body["verify"] = False
        try:
            b = c.call("POST", "/api/v1/bmcs", body)
        except ApiError as e:
            failed = True
            results.append({**out, "result": "failed", "detail": f"{e.detail} (HTTP {e.status})"})
            if not args.partial:
                # All or nothing: the rows after it are not tried, and say so.
                for rest in good[i + 1 :]:
                    results.append(
                        {
                            "line": rest.line,
                            "address": rest.address,
                            "machine": rest.machine or "-",
                            "result": "skipped",
                            "detail": f"not tried: line {r.line} failed",
                        }
                    )
                break
            continue
        created.append(b["id"])
        results.append({**out, "result": "registered", "detail": f"{b['id'][:8]} {b['health']}"})
    if failed and not args.partial:
        for bmc_id in created:  # all or nothing: take back what this run registered
            c.call("DELETE", f"/api/v1/bmcs/{bmc_id}")
        for r in results:
            if r["result"] == "registered":
                r.update(result="undone", detail="removed again (another row failed)")
    emit_table(
        args,
        {"items": results, "errors": [{"line": k, "detail": v} for k, v in sorted(errors.items())]},
        IMPORT_COLUMNS,
    )
    if failed and not args.partial:
        skipped = sum(1 for r in results if r["result"] == "skipped")
        print(
            f"metalctl: a row failed, so nothing was imported ({len(created)} undone, {skipped} "
            "not tried); fix it, add --partial to import the rows that work, or --no-verify to "
            "store BMCs that do not answer yet",
            file=sys.stderr,
        )
    return 1 if failed or errors else 0


def bmc_power(args: argparse.Namespace, c: Client) -> None:
    if args.action in DISRUPTIVE_POWER:
        confirm(args, f"power {args.action} the host of BMC {args.id}")
    r = _power(c, f"/api/v1/bmcs/{args.id}/power", args.action)
    emit(args, r, lambda r: f"bmc {args.id}: power {r.get('power_state')}")


def register_bmc(args: argparse.Namespace, c: Client) -> None:
    if refusal := bmcimport.password_env_refusal(args.password_env):
        raise UsageError(f"--password-env {args.password_env}: {refusal}")
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
    if args.no_verify:
        body["verify"] = False
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
