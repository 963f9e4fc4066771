"""``metalctl events``: the audit trail, listed or followed live (SSE)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .client import Client
from .options import Subparsers
from .output import as_json


def register(sub: Subparsers) -> None:
    e = sub.add_parser("events", help="list or follow events")
    e.add_argument("--machine")
    e.add_argument("--after", type=int, default=0)
    e.add_argument("--limit", type=int, default=100)
    e.add_argument("--follow", "-f", action="store_true")
    e.set_defaults(func=events)


def line(ev: dict[str, Any]) -> str:
    what = ev["kind"]
    if ev.get("from_state") or ev.get("to_state"):
        what += f" {ev.get('from_state') or '-'} -> {ev.get('to_state')}"
    machine = (ev.get("machine_id") or "-")[:8]
    return f"{ev['id']:>6} {ev['at'][:19]} {machine:8} {what:40} {ev['actor']}  {ev.get('reason') or ''}".rstrip()


def events(args: argparse.Namespace, c: Client) -> None:
    q = [("after", str(args.after)), ("limit", str(args.limit))]
    if args.machine:
        q.append(("machine_id", args.machine))
    if args.follow:
        after = args.after
        try:
            while True:  # the server ends a stream after its maximum life: resume it
                q[0] = ("after", str(after))
                for ev in c.stream("/api/v1/events/stream", q):
                    print(json.dumps(ev) if args.json else line(ev), flush=True)
                    after = ev["id"]
        except KeyboardInterrupt:
            return
    else:
        page = c.call("GET", "/api/v1/events", query=q)
        if args.json:
            print(as_json(page))
        else:
            for ev in page["items"]:
                print(line(ev))
