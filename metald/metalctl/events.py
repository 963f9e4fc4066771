"""``metalctl events``: the audit trail, listed or followed live (SSE)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from .client import ApiError, Client
from .options import Subparsers, UsageError, machine_ref
from .output import machine_readable, render


def register(sub: Subparsers) -> None:
    e = sub.add_parser("events", help="list or follow events")
    machine_ref(e.add_argument("--machine", help="only this machine's (id, name or id prefix)"))
    e.add_argument("--kind", help="only events of this kind, e.g. machine.state")
    e.add_argument("--after", type=int, default=0)
    e.add_argument(
        "--tail", "--limit", dest="limit", type=int, default=100, help="the newest N (default 100)"
    )
    e.add_argument("--follow", "-f", action="store_true", help="then follow new ones live")
    e.set_defaults(func=events)


class Names:
    """Machine ids to names for event lines, looked up once per machine (a machine without
    a name shows its 8-character id prefix, itself a valid reference)."""

    def __init__(self, c: Client) -> None:
        self.c = c
        self.known: dict[str, str] = {}

    def __call__(self, machine_id: str | None) -> str:
        if not machine_id:
            return "-"
        if machine_id not in self.known:
            try:
                name = self.c.call("GET", f"/api/v1/machines/{machine_id}").get("name")
            except ApiError:  # gone, or outside the token's scope
                name = None
            self.known[machine_id] = name or machine_id[:8]
        return self.known[machine_id]


def line(ev: dict[str, Any], name: Callable[[str | None], str] | None = None) -> str:
    what = ev["kind"]
    if ev.get("from_state") or ev.get("to_state"):
        what += f" {ev.get('from_state') or '-'} -> {ev.get('to_state')}"
    machine = name(ev.get("machine_id")) if name else (ev.get("machine_id") or "-")[:8]
    at = ev["at"][:19].replace("T", " ") + "Z"
    return (
        f"{ev['id']:>6} {at} {machine:12} {what:40} {ev['actor']}  {ev.get('reason') or ''}"
    ).rstrip()


def events(args: argparse.Namespace, c: Client) -> None:
    """A list is newest first (the newest --tail N); --follow prints oldest first, as they come."""
    if args.limit < 1:
        raise UsageError("--tail must be at least 1")
    q = [("after", str(args.after)), ("limit", str(args.limit))]
    if args.machine:
        q.append(("machine_id", c.call("GET", f"/api/v1/machines/{args.machine}")["id"]))
    if args.kind:
        q.append(("kind", args.kind))
    names = Names(c)
    if args.follow:
        after = args.after
        try:
            while True:  # the server ends a stream after its maximum life: resume it
                q[0] = ("after", str(after))
                for ev in c.stream("/api/v1/events/stream", q):
                    print(json.dumps(ev) if machine_readable(args) else line(ev, names), flush=True)
                    after = ev["id"]
        except KeyboardInterrupt:
            return
    else:
        page = c.call("GET", "/api/v1/events", query=[*q, ("sort", "-id")])
        if machine_readable(args):
            print(render(args, page))
        else:
            for ev in page["items"]:
                print(line(ev, names))
