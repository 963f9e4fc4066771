"""How metalctl prints: ``-o table`` (aligned columns, names first; the default), ``-o wide``
(the table's columns, then every other scalar field, none twice), ``-o custom-columns=HEADER:
field,...`` (the columns you name, as kubectl spells it; ``field`` may be dotted and indexed,
``labels.rack``, ``disks[0].name``; a field no item has is an error), ``-o name`` (``kind/name``
per item), ``-o jsonpath={...}`` (kubectl's template subset: ``.field``, ``[N]``, ``[*]``),
``-o json`` (the API's JSON; ``--json`` is the same) or ``-o yaml``."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any

import yaml

Columns = list[tuple[str, str]]

FORMATS = (
    "table",
    "wide",
    "json",
    "yaml",
    "name",
    "custom-columns=HEADER:field,...",
    "jsonpath={.field}",
)
PLAIN = FORMATS[:5]
CUSTOM = "custom-columns="
JSONPATH = "jsonpath="
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\[[0-9]+\])*(\.[A-Za-z0-9_/-]+(\[[0-9]+\])*)*")
_STEP = re.compile(r"\.([A-Za-z0-9_/-]+)|\[([0-9]+|\*)\]")


class UnknownField(ValueError):
    """A custom column or jsonpath names a field none of the items has."""


def _steps(path: str) -> list[str | int | None]:
    """``a.b[0]`` as ["a", "b", 0]; ``[*]`` is None (every item). ValueError if malformed."""
    text = path if path.startswith((".", "[")) else "." + path
    steps: list[str | int | None] = []
    pos = 0
    for m in _STEP.finditer(text):
        if m.start() != pos:
            break
        key, index = m.groups()
        steps.append(key if key is not None else (None if index == "*" else int(index)))
        pos = m.end()
    if pos != len(text) or not steps:
        raise ValueError(f"{path!r} is not a field path (write name, labels.rack, disks[0].name)")
    return steps


def lookup(value: Any, path: str) -> list[Any]:
    """Every value ``path`` reaches in ``value`` (a ``[*]`` step fans out); missing: []."""
    found = [value]
    for step in _steps(path):
        found = [x for v in found for x in _at(v, step)]
    return found


def _at(value: Any, step: str | int | None) -> list[Any]:
    if isinstance(value, list):
        if step is None:
            return value
        if isinstance(step, int) and -len(value) <= step < len(value):
            return [value[step]]
    if isinstance(value, dict) and isinstance(step, str) and step in value:
        return [value[step]]
    return []


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
    if value in PLAIN:
        return value
    if value.startswith(JSONPATH):
        try:
            jsonpath_parts(value[len(JSONPATH) :])
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value
    if value.startswith(CUSTOM):
        try:
            parse_custom_columns(value[len(CUSTOM) :])
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: choose one of {', '.join(FORMATS)}")


def text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def cell(row: dict[str, Any], field: str) -> str:
    """``row[field]`` as text; a dotted, indexed field walks into nested objects and lists
    (``labels.rack``, ``disks[0].name``)."""
    if field in row:
        return text(row[field])
    found = lookup(row, field)
    return ",".join(text(v) for v in found)


def check_fields(rows: list[dict[str, Any]], columns: Columns) -> None:
    """UnknownField for a column whose first step no row has (a typo printed blanks)."""
    if not rows:
        return
    for header, field in columns:
        first = _steps(field)[0]
        if not any(field in r or first in r for r in rows):
            known = sorted({k for r in rows for k in r if not k.endswith("_s")})
            raise UnknownField(
                f"column {header}: no field {first!r} in these items; fields: {', '.join(known)}"
            )


def jsonpath_parts(template: str) -> list[tuple[bool, str]]:
    """kubectl's ``{.items[*].name}`` template as (is a path, text) parts. ValueError if a
    brace is unbalanced or a path malformed (``range`` and filters are not supported)."""
    parts: list[tuple[bool, str]] = []
    rest = template
    while rest:
        start = rest.find("{")
        if start < 0:
            parts.append((False, rest))
            break
        end = rest.find("}", start)
        if end < 0:
            raise ValueError(f"jsonpath {template!r}: a {{ without its }}")
        if start:
            parts.append((False, rest[:start]))
        path = rest[start + 1 : end].strip()
        if path in ("", "."):
            parts.append((True, ""))
        else:
            _steps(path)  # ValueError names the path
            parts.append((True, path))
        rest = rest[end + 1 :]
    if not any(is_path for is_path, _ in parts):
        raise ValueError(f"jsonpath {template!r}: write a field in braces, e.g. {{.items[*].name}}")
    return parts


def render_jsonpath(template: str, data: Any) -> str:
    """The template with each ``{path}`` replaced by what it reaches in ``data`` (several
    values joined by spaces, as kubectl does); a path that reaches nothing is an error."""
    out = []
    for is_path, part in jsonpath_parts(template):
        if not is_path:
            out.append(part.encode().decode("unicode_escape") if "\\" in part else part)
            continue
        found = [data] if part == "" else lookup(data, part)
        if not found:
            raise UnknownField(f"jsonpath: {part} reaches nothing in the answer")
        out.append(" ".join(text(v) for v in found))
    return "".join(out)


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
    """The format for ``-o json``/``yaml``/``name``/``jsonpath=``, else None (human output)."""
    fmt = getattr(args, "output", "table") or "table"
    if fmt in ("json", "yaml", "name") or fmt.startswith(JSONPATH):
        return fmt
    return None


def names_of(data: Any, kind: str | None) -> str:
    """``-o name``: ``kind/name`` (the id where there is no name) for each item, as kubectl."""
    items = data.get("items") if isinstance(data, dict) and "items" in data else [data]
    lines = []
    for it in items:
        if isinstance(it, dict):
            ref = it.get("name") or it.get("id")
            lines.append(f"{kind}/{ref}" if kind else str(ref))
    return "\n".join(lines)


def render(args: argparse.Namespace, data: Any) -> str:
    fmt = machine_readable(args) or "json"
    if fmt == "yaml":
        return as_yaml(data)
    if fmt == "name":
        return names_of(data, getattr(args, "noun", None))
    if fmt.startswith(JSONPATH):
        return render_jsonpath(fmt[len(JSONPATH) :], data)
    return as_json(data)


def emit(args: argparse.Namespace, data: Any, human: Callable[[Any], str]) -> None:
    """Print ``data`` as JSON or YAML when asked (``-o json|yaml``), else as ``human(data)``."""
    print(render(args, data) if machine_readable(args) else human(data))


#: Table fields that show another field shortened or spelt out: ``-o wide`` shows none twice.
SHOWN_AS = {
    "short_id": "id",
    "name_s": "name",
    "labels_s": "labels",
    "tenant": "tenant_id",
    "why": "last_error",
}


def wide_columns(rows: list[dict[str, Any]], columns: Columns) -> Columns:
    """``columns`` (the ID one with the whole id) and then every other scalar field the rows
    carry (``-o wide``), none twice: not under its own name, its header or a short form."""
    base = [(h, "id" if k == "short_id" else k) for h, k in columns]
    have = {k for _, k in base} | {SHOWN_AS.get(k, k) for _, k in columns}
    headers = {h for h, _ in base}
    extra: list[str] = []
    for r in rows:
        for k, v in r.items():
            if (
                k not in have
                and k not in extra
                and k not in SHOWN_AS
                and k.upper() not in headers
                and not isinstance(v, dict | list)
            ):
                extra.append(k)
    return base + [(k.upper(), k) for k in extra]


def chosen_columns(
    args: argparse.Namespace, rows: list[dict[str, Any]], columns: Columns
) -> Columns:
    """The columns ``-o`` asks for: the default set, ``wide``, or ``custom-columns=``."""
    fmt = getattr(args, "output", "table") or "table"
    if fmt == "wide":
        return wide_columns(rows, columns)
    if fmt.startswith(CUSTOM):
        custom = parse_custom_columns(fmt[len(CUSTOM) :])
        check_fields(rows, custom)
        return custom
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
