"""Shared bench plumbing: namespaces and process helpers (from the lab), table printing."""

from __future__ import annotations

import os

from vmlab.lab import REPO_ROOT as ROOT
from vmlab.labnet import BootProcess, Netns, namespaces, sh, veth, write_config

__all__ = [
    "ROOT",
    "BootProcess",
    "Netns",
    "namespaces",
    "set_loop",
    "sh",
    "veth",
    "write_config",
    "table",
]


def set_loop(server: str) -> None:
    """``metald`` runs on its default event loop; ``metald-asyncio`` / ``metald-uvloop`` force
    one (METALD_EVENT_LOOP, inherited by the metald process the bench starts next)."""
    _, _, loop = server.partition("-")
    if loop:
        os.environ["METALD_EVENT_LOOP"] = loop
    else:
        os.environ.pop("METALD_EVENT_LOOP", None)


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
