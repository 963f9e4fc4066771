"""Shared bench plumbing: namespaces and process helpers (from the lab), table printing."""

from __future__ import annotations

from vmlab.lab import REPO_ROOT as ROOT
from vmlab.labnet import BootProcess, Netns, namespaces, sh, veth, write_config

__all__ = ["ROOT", "BootProcess", "Netns", "namespaces", "sh", "veth", "write_config", "table"]


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
