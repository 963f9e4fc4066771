"""``metalctl events``: the audit trail, listed or followed live (SSE)."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from .client import ApiError, Client
from .options import Subparsers, UsageError, machine_ref
from .output import machine_readable, render


def register(sub: Subparsers) -> None:
    e = sub.add_parser("events", help="list or follow events")
    machine_ref(e.add_argument("--machine", help="only this machine's (id, name or id prefix)"))
    e.add_argument("--kind", help="only events of this kind, e.g. machine.state")
    e.add_argument(
        "--after", type=int, default=None, help="only events delivered after the one with this id"
    )
    e.add_argument(
        "--since",
        type=since,
        help="only events at or after a time: a duration back from now (90s, 10m, 2h, 1d) or "
        "an RFC 3339 time (2026-12-06T17:00:00Z)",
    )
    e.add_argument(
        "--tail",
        "--limit",
        dest="limit",
        type=int,
        default=None,
        help=f"the newest N (default {LIST_TAIL}; with --follow, {FOLLOW_TAIL} before the live ones)",
    )
    e.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="show the newest (--tail N, or from --since/--after), then follow new ones live",
    )
    e.set_defaults(func=events)


#: How many of the newest events a list shows, and a follow shows before the live ones.
LIST_TAIL = 100
FOLLOW_TAIL = 10
_DURATION = re.compile(r"([0-9]+)([smhd])")
_UNIT = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def since(value: str) -> str:
    """``--since``: a duration back from now or an RFC 3339 time, as the API's ``since``."""
    m = _DURATION.fullmatch(value.strip())
    if m:
        at = datetime.now(UTC) - timedelta(**{_UNIT[m.group(2)]: int(m.group(1))})
    else:
        try:
            at = datetime.fromisoformat(value.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{value!r} is neither a duration (90s, 10m, 2h, 1d) nor a time "
                "(2026-12-06T17:00:00Z)"
            ) from None
        if at.tzinfo is None:
            at = at.replace(tzinfo=UTC)  # metald's times are UTC
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


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
    """A list is newest first (the newest --tail N). --follow prints oldest first, as they come:
    the newest --tail N, or everything from --since or after --after, then the live ones."""
    limit = args.limit if args.limit is not None else (FOLLOW_TAIL if args.follow else LIST_TAIL)
    if limit < 1:
        raise UsageError("--tail must be at least 1")
    q: list[tuple[str, str]] = [("limit", str(limit))]
    if args.machine:
        q.append(("machine_id", c.call("GET", f"/api/v1/machines/{args.machine}")["id"]))
    if args.kind:
        q.append(("kind", args.kind))
    if args.since:
        q.append(("since", args.since))
    names = Names(c)

    def show(ev: dict[str, Any]) -> None:
        fmt = machine_readable(args)
        text = json.dumps(ev) if fmt == "json" else render(args, ev) if fmt else line(ev, names)
        print(text, flush=True)

    if not args.follow:
        page = c.call(
            "GET", "/api/v1/events", query=[*q, ("after", str(args.after or 0)), ("sort", "-id")]
        )
        if machine_readable(args):
            print(render(args, page))
        else:
            for ev in page["items"]:
                print(line(ev, names))
        return
    if args.after is not None or args.since:
        after = args.after or 0  # the stream itself replays from there
    else:
        # Start at the tail: the newest N (oldest first), then the stream after them.
        page = c.call("GET", "/api/v1/events", query=[*q, ("sort", "-id")])
        for ev in reversed(page["items"]):
            show(ev)
        after = page["next_after"]
    try:
        while True:  # the server ends a stream after its maximum life: resume it
            for ev in c.stream("/api/v1/events/stream", [*q, ("after", str(after))]):
                show(ev)
                after = ev["id"]
    except KeyboardInterrupt:
        return
