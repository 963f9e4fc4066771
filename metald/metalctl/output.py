"""How metalctl prints: ``-o table`` (aligned columns, the default), ``-o wide`` (every
scalar field as a column), ``-o json`` (the API's JSON; ``--json`` is the same) or ``-o yaml``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import yaml

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


def as_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True).rstrip("\n")


FORMATS = ("table", "wide", "json", "yaml")


def machine_readable(args: argparse.Namespace) -> str | None:
    """``as_json``/``as_yaml``'s output for ``-o json``/``-o yaml``, else None."""
    fmt = getattr(args, "output", "table")
    return fmt if fmt in ("json", "yaml") else None


def render(args: argparse.Namespace, data: Any) -> str:
    return as_yaml(data) if machine_readable(args) == "yaml" else as_json(data)


def emit(args: argparse.Namespace, data: Any, human: Callable[[Any], str]) -> None:
    """Print ``data`` as JSON or YAML when asked (``-o json|yaml``), else as ``human(data)``."""
    print(render(args, data) if machine_readable(args) else human(data))


def wide_columns(rows: list[dict[str, Any]], columns: Columns) -> Columns:
    """``columns`` and then every other scalar field the rows carry (``-o wide``)."""
    have = {k for _, k in columns}
    extra: list[str] = []
    for r in rows:
        for k, v in r.items():
            if k not in have and k not in extra and not isinstance(v, dict | list):
                extra.append(k)
    return columns + [(k.upper(), k) for k in extra]


def emit_table(args: argparse.Namespace, data: Any, columns: Columns, key: str = "items") -> None:
    """A list page: JSON or YAML when asked, else a table of ``data[key]`` (every scalar field
    with ``-o wide``)."""

    def human(d: Any) -> str:
        rows = d.get(key, [])
        wide = getattr(args, "output", "table") == "wide"
        return table(rows, wide_columns(rows, columns) if wide else columns)

    emit(args, data, human)
