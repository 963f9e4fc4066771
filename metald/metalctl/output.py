"""How metalctl prints: the API's JSON with ``--json``, else aligned tables and short lines."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

Columns = list[tuple[str, str]]


def table(rows: list[dict[str, Any]], columns: Columns) -> str:
    """Left-aligned columns under their headers; ``columns`` is (header, key) pairs."""
    cells = [[h for h, _ in columns]] + [
        ["" if r.get(k) is None else str(r.get(k)) for _, k in columns] for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(c[i].ljust(widths[i]) for i in range(len(columns))).rstrip() for c in cells
    )


def as_json(data: Any) -> str:
    return json.dumps(data, indent=2)


def emit(args: argparse.Namespace, data: Any, human: Callable[[Any], str]) -> None:
    """Print ``data`` as the API's JSON under ``--json``, else as ``human(data)``."""
    print(as_json(data) if args.json else human(data))


def emit_table(args: argparse.Namespace, data: Any, columns: Columns, key: str = "items") -> None:
    """A list page: JSON under ``--json``, else a table of ``data[key]``."""
    emit(args, data, lambda d: table(d.get(key, []), columns))
