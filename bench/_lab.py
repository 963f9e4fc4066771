"""Shared bench plumbing: namespaces (from the boot tests), process helpers, table printing."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from boot.labnet import BootProcess, Netns, namespaces, sh, veth, write_config  # noqa: E402

__all__ = ["ROOT", "BootProcess", "Netns", "namespaces", "sh", "veth", "write_config", "table"]


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
