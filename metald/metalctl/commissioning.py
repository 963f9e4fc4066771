"""``metalctl machines commissioning ID`` (the last run, each check's verdict and sentence, and
the history; ``--raw CHECK`` prints that check's raw output) and ``machines commission ID``."""

from __future__ import annotations

import argparse
from typing import Any

from .client import Client
from .output import emit


def register(msub: Any) -> None:
    mc = msub.add_parser("commissioning", help="a machine's last commissioning run and history")
    mc.add_argument("id", help="id, name or id prefix")
    mc.add_argument("--raw", metavar="CHECK", help="print the raw output of CHECK of the last run")
    mc.set_defaults(func=show)
    mk = msub.add_parser("commission", help="commission again (ready, maintenance, or failed)")
    mk.add_argument("id", help="id, name or id prefix")
    mk.add_argument("--reason")
    mk.set_defaults(func=commission)


def _run_lines(run: dict[str, Any], *, detail: bool) -> list[str]:
    when = run.get("finished_at") or run.get("started_at") or run["created_at"]
    lines = [f"run {run['id'][:8]}  {run['profile']}  {run['status']}  {when}"]
    if run.get("summary") and run["status"] != "passed":
        lines.append(f"  why: {run['summary']}")
    if detail:
        for r in run["results"]:
            took = "" if r["duration_s"] is None else f" {r['duration_s']:.1f}s"
            lines.append(f"  {r['check']:<11} {r['status']:<8}{took}  {r['sentence']}")
    return lines


def _text(out: dict[str, Any]) -> str:
    lines = [f"machine {out['machine_id']}: {out['state']}"]
    if out["last"] is None:
        return "\n".join([*lines, "never commissioned"])
    lines += _run_lines(out["last"], detail=True)
    if out["history"]:
        lines.append("earlier:")
        for run in out["history"]:
            lines += ["  " + x for x in _run_lines(run, detail=False)]
    return "\n".join(lines)


def show(args: argparse.Namespace, c: Client) -> None:
    out = c.call("GET", f"/api/v1/machines/{args.id}/commissioning")
    if args.raw:
        last = out["last"] or {"results": []}
        found = [r for r in last["results"] if r["check"] == args.raw]
        if not found:
            raise SystemExit(f"no check {args.raw!r} in the last run")
        print(found[0]["raw"] or "(no output kept)")
        return
    emit(args, out, _text)


def commission(args: argparse.Namespace, c: Client) -> None:
    body = {"reason": args.reason} if args.reason else {}
    out = c.call("POST", f"/api/v1/machines/{args.id}/commission", body)
    emit(args, out, lambda o: f"{o['machine_id']}: {o['state']} (commissioning requested)")
