"""``metalctl firmware``: a machine's firmware versions (``show ID``; ``firmware ID`` still
works), the baselines per SKU profile, the fleet's compliance, and updates through the BMC."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import bmc
from .client import Client
from .options import Subparsers, UsageError, machine_ref
from .output import emit, emit_table

SUBCOMMANDS = (
    "show", "baselines", "baseline", "compliance", "update", "updates", "rollout", "rollouts",
)  # fmt: skip
BASELINE_COLUMNS = [("PROFILE", "profile"), ("VERSION", "version"), ("COMPONENTS", "summary")]
COMPLIANCE_COLUMNS = [
    ("MACHINE", "machine"),
    ("STATE", "state"),
    ("PROFILE", "profile"),
    ("BASELINE", "baseline_version"),
    ("OFF BASELINE", "off"),
]


def register(sub: Subparsers) -> None:
    fw = sub.add_parser("firmware", help="firmware versions, baselines, compliance, updates")
    fsub = fw.add_subparsers(dest="sub", required=True)
    sh = fsub.add_parser("show", help="firmware versions the machine's BMC reports (read now)")
    machine_ref(sh.add_argument("id", help="machine id, name or id prefix"))
    sh.set_defaults(func=bmc.firmware)
    bl = fsub.add_parser("baselines", help="the newest baseline of each SKU profile")
    bl.set_defaults(func=baselines)
    b1 = fsub.add_parser("baseline", help="show a profile's baseline, or --set it from a file")
    b1.add_argument("profile")
    b1.add_argument(
        "--set", dest="file", metavar="FILE", help="JSON: {components: [...], note} (admins)"
    )
    b1.set_defaults(func=baseline)
    co = fsub.add_parser("compliance", help="machines off their profile's firmware baseline")
    co.add_argument("--profile")
    co.add_argument("--all", action="store_true", help="list compliant machines too")
    co.set_defaults(func=compliance)
    up = fsub.add_parser("update", help="flash the machine's components off its baseline")
    machine_ref(up.add_argument("id", help="machine id, name or id prefix"))
    up.add_argument("components", nargs="*", metavar="COMPONENT", help="only these (inventory ids)")
    up.set_defaults(func=update)
    us = fsub.add_parser("updates", help="a machine's firmware updates and their progress")
    machine_ref(us.add_argument("id", help="machine id, name or id prefix"))
    us.set_defaults(func=updates)
    ro = fsub.add_parser("rollout", help="start a rollout, or pause / resume / abort one (admins)")
    rsub = ro.add_subparsers(dest="rollout_sub", required=True)
    rs = rsub.add_parser("start", help="update a profile's machines to a baseline version in waves")
    rs.add_argument("profile")
    rs.add_argument("version", type=int)
    rs.add_argument("--rack", help="only machines of this rack")
    rs.add_argument("--label", action="append", default=[], metavar="K=V", help="only these")
    rs.add_argument("--batch-size", type=int, default=10, help="machines per wave (10)")
    rs.add_argument("--max-unavailable", type=int, default=10, help="updating at once (10)")
    rs.add_argument("--failure-budget", type=int, default=1, help="stop once this many failed (1)")
    rs.add_argument("--in-use", choices=("skip", "wait", "drain"), default="skip",
                    help="machines a tenant holds: skip them, wait for their release, or "
                    "drain them where the tenant consented (metalctl claims "
                    "firmware-consent)")  # fmt: skip
    rs.set_defaults(func=rollout_start)
    for action in ("pause", "resume", "abort"):
        ra = rsub.add_parser(action, help=f"{action} a rollout")
        ra.add_argument("id")
        ra.set_defaults(func=rollout_action, action=action)
    rl = fsub.add_parser("rollouts", help="rollouts and their progress (one: its machines)")
    rl.add_argument("id", nargs="?", help="one rollout: its machines, wave by wave")
    rl.set_defaults(func=rollouts)


def fix_argv(argv: list[str]) -> list[str]:
    """``firmware ID`` (before baselines existed) is ``firmware show ID``."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] in ("-o", "--output", "--url") else 1
    if i + 1 < len(argv) and argv[i] == "firmware":
        nxt = argv[i + 1]
        if nxt not in SUBCOMMANDS and not nxt.startswith("-"):
            return [*argv[: i + 1], "show", *argv[i + 1 :]]
    return argv


def _summary(b: dict[str, Any]) -> str:
    return ", ".join(f"{c['id']}={c['version']}" for c in b["components"])


def baselines(args: argparse.Namespace, c: Client) -> None:
    out = c.call("GET", "/api/v1/firmware/baselines")
    emit_table(args, out, BASELINE_COLUMNS, row=lambda b: {**b, "summary": _summary(b)})


def baseline(args: argparse.Namespace, c: Client) -> None:
    path = f"/api/v1/firmware/baselines/{args.profile}"
    if args.file:
        try:
            body = json.loads(Path(args.file).read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read the baseline from {args.file}: {e}") from None
        out = c.call("PUT", path, body)
    else:
        out = c.call("GET", path)

    def human(b: dict[str, Any]) -> str:
        lines = [f"profile {b['profile']} version {b['version']} by {b['created_by']}"]
        for comp in b["components"]:
            flash = f" from {comp['url']} ({comp['apply']})" if comp.get("url") else ""
            lines.append(f"  {comp['id']:16} {comp['version']}{flash}")
        return "\n".join(lines)

    emit(args, out, human)


def compliance(args: argparse.Namespace, c: Client) -> None:
    query = []
    if args.profile:
        query.append(f"profile={args.profile}")
    if args.all:
        query.append("all=true")
    out = c.call("GET", "/api/v1/firmware/compliance" + ("?" + "&".join(query) if query else ""))

    def row(m: dict[str, Any]) -> dict[str, Any]:
        off = ", ".join(
            f"{f['item'] or f['component']} {f['have'] or f['status']} (want {f['want']})"
            for f in m["off_baseline"]
        )
        return {**m, "machine": m["name"] or m["machine_id"], "off": off or "-"}

    emit_table(args, out, COMPLIANCE_COLUMNS, row=row)


UPDATE_COLUMNS = [
    ("ID", "short_id"),
    ("ITEM", "item"),
    ("FROM", "version_before"),
    ("TO", "version"),
    ("PHASE", "phase"),
    ("PROGRESS", "progress"),
    ("ERROR", "error"),
]


def _update_row(u: dict[str, Any]) -> dict[str, Any]:
    pct = u.get("percent")
    return {**u, "short_id": u["id"][:8], "progress": "" if pct is None else f"{pct}%"}


def update(args: argparse.Namespace, c: Client) -> None:
    body = {"components": args.components} if args.components else {}
    out = c.call("POST", f"/api/v1/machines/{args.id}/firmware/update", body)
    emit_table(args, out, UPDATE_COLUMNS, row=_update_row)


def updates(args: argparse.Namespace, c: Client) -> None:
    out = c.call("GET", f"/api/v1/machines/{args.id}/firmware/updates")
    emit_table(args, out, UPDATE_COLUMNS, row=_update_row)


ROLLOUT_COLUMNS = [
    ("ID", "short_id"),
    ("PROFILE", "profile"),
    ("VERSION", "baseline_version"),
    ("STATE", "state"),
    ("PROGRESS", "bar"),
    ("DONE", "n_done"),
    ("FAILED", "n_failed"),
    ("SKIPPED", "n_skipped"),
    ("WAVE", "wave"),
]
TARGET_COLUMNS = [
    ("MACHINE", "machine_id"),
    ("WAVE", "wave"),
    ("STATUS", "status"),
    ("ERROR", "error"),
]
BAR_WIDTH = 20


def bar(progress: dict[str, Any], width: int = BAR_WIDTH) -> str:
    """``[#######.....   ] 45%``: # ended well, ! failed, . skipped, > updating."""
    total = progress["total"] or 1
    cells = []
    for key, ch in (("done", "#"), ("failed", "!"), ("skipped", "."), ("updating", ">")):
        cells.append(ch * round(width * progress[key] / total))
    body = "".join(cells)[:width]
    return f"[{body.ljust(width)}] {progress['percent']}%"


def _rollout_row(r: dict[str, Any]) -> dict[str, Any]:
    p = r["progress"]
    return {**r, "short_id": r["id"][:8], "bar": bar(p), "n_done": p["done"],
            "n_failed": p["failed"], "n_skipped": p["skipped"], "wave": p["wave"]}  # fmt: skip


def _rollout_human(r: dict[str, Any]) -> str:
    p = r["progress"]
    lines = [
        f"rollout {r['id']}: profile {r['profile']} to baseline version {r['baseline_version']}",
        f"  {r['state']} {bar(p)}  {p['done']} done, {p['failed']} failed, "
        f"{p['skipped']} skipped, {p['updating']} updating, "
        + (f"{p['draining']} draining, " if p.get("draining") else "")
        + f"{p['pending'] + p['waiting'] + p.get('draining', 0)} to go "
        f"(of {p['total']}); wave {p['wave']}",
        f"  waves of {r['batch_size']}, at most {r['max_unavailable']} at once, stops after "
        f"{r['failure_budget']} failure(s), machines in use: {r['in_use']}",
    ]
    if r.get("reason"):
        lines.append(f"  {r['reason']}")
    for t in r.get("targets") or []:
        err = f"  {t['error']}" if t.get("error") else ""
        lines.append(f"  {t['machine_id']}  wave {t['wave'] or '-':>3}  {t['status']:9}{err}")
    return "\n".join(lines)


def rollout_start(args: argparse.Namespace, c: Client) -> None:
    selector: dict[str, Any] = {}
    if args.rack:
        selector["rack"] = args.rack
    if args.label:
        try:
            selector["labels"] = dict(lbl.split("=", 1) for lbl in args.label)
        except ValueError:
            raise UsageError("--label takes KEY=VALUE") from None
    body = {
        "profile": args.profile,
        "version": args.version,
        "selector": selector,
        "batch_size": args.batch_size,
        "max_unavailable": args.max_unavailable,
        "failure_budget": args.failure_budget,
        "in_use": args.in_use,
    }
    emit(args, c.call("POST", "/api/v1/firmware/rollouts", body), _rollout_human)


def rollout_action(args: argparse.Namespace, c: Client) -> None:
    out = c.call("POST", f"/api/v1/firmware/rollouts/{args.id}/actions", {"action": args.action})
    emit(args, out, _rollout_human)


def rollouts(args: argparse.Namespace, c: Client) -> None:
    if args.id:
        emit(args, c.call("GET", f"/api/v1/firmware/rollouts/{args.id}"), _rollout_human)
        return
    out = c.call("GET", "/api/v1/firmware/rollouts")
    emit_table(args, out, ROLLOUT_COLUMNS, row=_rollout_row)
