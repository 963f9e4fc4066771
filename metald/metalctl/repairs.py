"""``metalctl machines repairs``: the repair queue (list, show, open, take, release, note,
repaired).

``list`` shows the open queue (``--status closed|all`` for the rest): machine, rack position,
the fault, the part to look at and who took it. ``open MACHINE --summary ...`` puts a machine
in the queue by hand (instead of a bare ``mark-broken``); ``repaired`` sends it back through
commissioning."""

from __future__ import annotations

import argparse
from typing import Any

from .client import Client
from .options import machine_ref
from .output import emit, emit_table

COLUMNS = [
    ("MACHINE", "machine_s"),
    ("RACK", "rack_s"),
    ("STATUS", "status"),
    ("FAULT", "summary"),
    ("PART", "part_s"),
    ("TAKEN_BY", "taken_s"),
    ("FAILS", "commission_failures"),
    ("ID", "short_id"),
]
STATUSES = ("open", "taken", "verifying", "closed", "all")


def register(msub: Any) -> None:
    rp = msub.add_parser(
        "repairs", help="the repair queue: list, show, open, take, release, note, repaired"
    )
    rsub = rp.add_subparsers(dest="repairs_sub", required=True)
    rl = rsub.add_parser("list", help="the queue (open ones unless --status)")
    rl.add_argument("--status", choices=STATUSES, default="open")
    rl.add_argument("--rack")
    rl.add_argument("--taken-by", dest="taken_by", help="the token that took it (role:name)")
    rl.add_argument("--machine", help="one machine's repairs (id or name)")
    rl.add_argument("--limit", type=int)
    rl.set_defaults(func=list_repairs)
    rs = rsub.add_parser("show", help="one repair: faults with evidence, parts, notes")
    rs.add_argument("id", help="repair id or 8+ character id prefix")
    rs.set_defaults(func=show)
    ro = rsub.add_parser("open", help="put a machine in the queue by hand (marks it broken)")
    machine_ref(ro.add_argument("machine", help="id, name or id prefix"))
    ro.add_argument("--summary", required=True, help="what is wrong, in a sentence")
    ro.add_argument("--part", help="the part to look at (gpu, dimm, psu, fan, disk ...)")
    ro.set_defaults(func=open_repair)
    rt = rsub.add_parser("take", help="work on it: the machine goes to repairing")
    rt.add_argument("id", help="repair id or 8+ character id prefix")
    rt.set_defaults(func=take)
    rl2 = rsub.add_parser("release", help="let go of a taken repair: back in the queue")
    rl2.add_argument("id", help="repair id or 8+ character id prefix")
    rl2.set_defaults(func=release)
    rn = rsub.add_parser("note", help="what was found or swapped")
    rn.add_argument("id", help="repair id or 8+ character id prefix")
    rn.add_argument("text")
    rn.set_defaults(func=note)
    rr = rsub.add_parser("repaired", help="done: the machine goes back through commissioning")
    rr.add_argument("id", help="repair id or 8+ character id prefix")
    rr.add_argument("--note", help="what was done (kept as a note)")
    rr.set_defaults(func=repaired)


def row(r: dict[str, Any]) -> dict[str, Any]:
    out = dict(r)
    m = r.get("machine") or {}
    out["machine_s"] = m.get("name") or r["machine_id"][:8]
    out["rack_s"] = "/".join(x for x in (m.get("rack"), m.get("rack_position")) if x) or "-"
    out["part_s"] = "; ".join(p["where"] for p in r.get("parts") or []) or "-"
    out["taken_s"] = r.get("taken_by") or "-"
    out["short_id"] = r["id"][:8]
    return out


def list_repairs(args: argparse.Namespace, c: Client) -> None:
    q = [("status", args.status)]
    for key in ("rack", "taken_by", "machine", "limit"):
        if getattr(args, key) is not None:
            q.append((key, str(getattr(args, key))))
    page = c.call("GET", "/api/v1/repairs", query=q)
    emit_table(
        args, page, COLUMNS, row=row, footer=lambda p: f"({len(p['items'])} of {p['total']})"
    )


def _details(r: dict[str, Any]) -> str:
    x = row(r)
    m = r.get("machine") or {}
    lines = [
        f"repair {r['id']}  {r['status']}" + (f" ({r['outcome']})" if r.get("outcome") else ""),
        f"machine:   {x['machine_s']} ({r['machine_id']}), {m.get('state')}, rack {x['rack_s']}",
        f"opened:    {r['opened_at']} by {r['opened_by']} ({r['source']})",
        f"fault:     {r['summary']}",
        f"taken by:  {x['taken_s']}" + (f" at {r['taken_at']}" if r.get("taken_at") else ""),
        f"commissioning failures after repair: {r['commission_failures']}",
    ]
    if r.get("outcome_reason"):
        lines.append(f"why:       {r['outcome_reason']}")
    lines.append("look at:")
    lines += [f"  {p['part']}: {p['where']}" for p in r["parts"]]
    lines.append("evidence:")
    lines += [
        f"  [{f['severity']}] {f['witness']} {f['kind']} {f['subject']} "
        f"(first seen {f['first_seen']}): {f['evidence']}"
        for f in r["faults"]
    ]
    if r["notes"]:
        lines.append("notes:")
        lines += [f"  {n['at']} {n['by']}: {n['text']}" for n in r["notes"]]
    if r["actions"]:
        lines.append(f"actions:   {', '.join(r['actions'])}")
    return "\n".join(lines)


def show(args: argparse.Namespace, c: Client) -> None:
    emit(args, c.repair(args.id), _details)


def _one_line(r: dict[str, Any]) -> str:
    x = row(r)
    return (
        f"repair {x['short_id']} ({x['machine_s']}): {r['status']}, machine {r['machine']['state']}"
    )


def open_repair(args: argparse.Namespace, c: Client) -> None:
    emit(args, c.open_repair(args.machine, args.summary, part=args.part), _one_line)


def take(args: argparse.Namespace, c: Client) -> None:
    emit(args, c.take_repair(args.id), _one_line)


def release(args: argparse.Namespace, c: Client) -> None:
    emit(args, c.release_repair(args.id), _one_line)


def note(args: argparse.Namespace, c: Client) -> None:
    emit(args, c.note_repair(args.id, args.text), _one_line)


def repaired(args: argparse.Namespace, c: Client) -> None:
    emit(args, c.repaired(args.id, args.note), _one_line)
