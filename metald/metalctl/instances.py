"""``metalctl instances``: the metald instances sharing the store, alive or not, and their share."""

from __future__ import annotations

import argparse
from typing import Any

from .client import Client
from .options import Subparsers
from .output import emit_table

COLUMNS = [
    ("NAME", "name"),
    ("ALIVE", "alive"),
    ("HEARTBEAT", "heartbeat"),
    ("VERSION", "version"),
    ("BMCS", "bmcs"),
    ("HUBS", "hubs"),
    ("NETWORKS", "networks"),
    ("API", "api_url"),
]


def register(sub: Subparsers) -> None:
    p = sub.add_parser("instances", help="list metald instances (fleet)")
    p.set_defaults(func=instances)
    isub = p.add_subparsers(dest="sub")
    isub.add_parser("list", help="the instances sharing the store, alive or not").set_defaults(
        func=instances
    )


def _row(i: dict[str, Any]) -> dict[str, Any]:
    owns = i.get("owns") or {}
    return {
        **i,
        "alive": "yes" if i["alive"] else "DEAD",
        "heartbeat": f"{i['heartbeat_age_s']:.1f}s ago",
        "bmcs": owns.get("bmcs", 0),
        "hubs": "yes" if owns.get("hubs") else "-",
        "networks": ",".join(owns.get("networks") or []) or "-",
    }


def instances(args: argparse.Namespace, c: Client) -> None:
    emit_table(
        args,
        c.call("GET", "/api/v1/instances"),
        COLUMNS,
        row=_row,
        footer=lambda d: f"(answered by {d['answered_by']})",
    )
