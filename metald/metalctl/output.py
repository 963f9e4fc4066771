"""How metalctl prints: ``-o table`` (aligned columns, names first; the default), ``-o wide``
(every scalar field as a column), ``-o custom-columns=HEADER:field,...`` (the columns you
name, as kubectl spells it; ``field`` may be dotted, ``labels.rack``), ``-o json`` (the API's
JSON; ``--json`` is the same) or ``-o yaml``."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any

import yaml

Columns = list[tuple[str, str]]

FORMATS = ("table", "wide", "json", "yaml", "custom-columns=HEADER:field,...")
CUSTOM = "custom-columns="
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_./-]+)?")


def parse_custom_columns(spec: str) -> Columns:
    """``NAME:name,STATE:state`` (or just ``name,state``: the header is the field upper-cased)
    as (header, field) pairs; ValueError with what is wrong."""
    columns: Columns = []
    for part in spec.split(","):
        header, sep, field = part.strip().partition(":")
        if not sep:
            header, field = header.upper().replace(".", "_"), header
        header, field = header.strip(), field.strip().removeprefix(".")
        if not header or not _FIELD.fullmatch(field):
            raise ValueError(
                f"column {part.strip()!r}: write HEADER:field or field, e.g. "
                "custom-columns=NAME:name,STATE:state,RACK:labels.rack"
            )
        columns.append((header, field))
    return columns


def output_format(value: str) -> str:
    """argparse ``type`` of ``-o``: one of FORMATS (exit 2 with the choices otherwise)."""
    if value in FORMATS[:4]:
        return value
    if value.startswith(CUSTOM):
        try:
            parse_custom_columns(value[len(CUSTOM) :])
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: choose one of {', '.join(FORMATS)}")


def cell(row: dict[str, Any], field: str) -> str:
    """``row[field]`` as text; a dotted field walks into nested objects (``labels.rack``)."""
    value: Any = row
    for key in field.split(".") if field not in row else [field]:
        value = value.get(key) if isinstance(value, dict) else None
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def table(rows: list[dict[str, Any]], columns: Columns) -> str:
    """Left-aligned columns under their headers; ``columns`` is (header, key) pairs."""
    cells = [[h for h, _ in columns]] + [[cell(r, k) for _, k in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(c[i].ljust(widths[i]) for i in range(len(columns))).rstrip() for c in cells
    )


def as_json(data: Any) -> str:
    return json.dumps(data, indent=2)


def as_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True).rstrip("\n")


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


def chosen_columns(
    args: argparse.Namespace, rows: list[dict[str, Any]], columns: Columns
) -> Columns:
    """The columns ``-o`` asks for: the default set, ``wide``, or ``custom-columns=``."""
    fmt = getattr(args, "output", "table") or "table"
    if fmt == "wide":
        return wide_columns(rows, columns)
    if fmt.startswith(CUSTOM):
        return parse_custom_columns(fmt[len(CUSTOM) :])
    return columns


def emit_table(
    args: argparse.Namespace,
    data: Any,
    columns: Columns,
    key: str = "items",
    *,
    row: Callable[[dict[str, Any]], dict[str, Any]] = dict,
    footer: Callable[[Any], str] | None = None,
) -> None:
    """A list page: JSON or YAML when asked, else a table of ``row(item)`` for each of
    ``data[key]`` in the columns ``-o`` chose, then ``footer(data)`` if given."""

    def human(d: Any) -> str:
        rows = [row(r) for r in d.get(key, [])]
        text = table(rows, chosen_columns(args, rows, columns))
        return text + (f"\n{footer(d)}" if footer else "")

    emit(args, data, human)
