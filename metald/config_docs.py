"""The configuration's documentation has one source, ``examples/metald.toml``: every key there
with its default and the comment above it (or beside it). ``metald config-schema`` gives each
key of the JSON Schema that comment as its description, and ``examples_path`` finds the file
in a checkout or where the wheel installs it (``<venv>/share/metald/metald.toml``)."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path
from typing import Any

#: Where the wheel installs the shipped files (pyproject's data-files), under the venv.
SHARE = Path("share") / "metald"
_HEADER = re.compile(r"\[\[?\s*([A-Za-z0-9_.]+)\s*\]\]?\s*(?:#\s*(.*))?")
_KEY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*)")


def share_dir() -> Path:
    """The folder of shipped files: the venv's share/metald, or this checkout's deploy files."""
    installed = Path(sys.prefix) / SHARE
    return installed if installed.is_dir() else Path(__file__).resolve().parents[1]


def examples_path() -> Path | None:
    for p in (
        Path(sys.prefix) / SHARE / "metald.toml",
        Path(__file__).resolve().parents[1] / "examples" / "metald.toml",
    ):
        if p.is_file():
            return p
    return None


def _value_and_comment(rest: str) -> tuple[str, str] | None:
    """``value  # comment`` split where the TOML value ends; None if it is not a value."""
    for i in [m.start() for m in re.finditer("#", rest)] + [len(rest)]:
        value = rest[:i].strip()
        try:
            tomllib.loads(f"v = {value}")
        except tomllib.TOMLDecodeError:
            continue
        return value, rest[i + 1 :].strip() if i < len(rest) else ""
    return None


def descriptions(text: str) -> dict[str, str]:
    """``section.key`` -> its comment, for every key and table in the example (commented-out
    ones too): the comment block above it (shared by the keys under it until a blank line)
    and the comment beside it."""
    out: dict[str, str] = {}
    section: list[str] = []
    block: list[str] = []
    last: str | None = None  # the key just read: an indented comment line continues its own
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            block, last = [], None
            continue
        commented = line.startswith("#")
        body = line.lstrip("#").strip() if commented else line
        if header := _HEADER.fullmatch(body):
            section = header.group(1).split(".")
            doc = " ".join([*block, header.group(2) or ""]).strip()
            if doc:
                out.setdefault(".".join(section), doc)
            block, last = [], None
            continue
        key = _KEY.fullmatch(body)
        parsed = _value_and_comment(key.group(2)) if key else None
        if key and parsed is not None:
            last = ".".join([*section, key.group(1)])
            doc = " ".join([*block, parsed[1]]).strip()
            if doc:
                out.setdefault(last, doc)
            continue
        if commented and last is not None and raw[:1].isspace():
            out[last] = f"{out.get(last, '')} {body}".strip()
            continue
        if commented:
            if last is not None:
                block, last = [], None
            block.append(body)
    return out


def describe_schema(schema: dict[str, Any], docs: dict[str, str]) -> dict[str, Any]:
    """``schema`` with each property that has no description given its ``docs`` entry."""
    defs = schema.get("$defs", {})

    def target(prop: dict[str, Any]) -> dict[str, Any] | None:
        for cand in (prop, *(prop.get("allOf") or []), *(prop.get("anyOf") or [])):
            ref = cand.get("$ref") or (cand.get("items") or {}).get("$ref")
            if ref:
                return defs.get(ref.rsplit("/", 1)[-1])
        return None

    def walk(node: dict[str, Any], path: list[str], seen: frozenset[int]) -> None:
        for key, prop in node.get("properties", {}).items():
            here = [*path, key]
            doc = docs.get(".".join(here))
            if doc and not prop.get("description"):
                prop["description"] = doc
            sub = target(prop)
            if sub is not None and id(sub) not in seen:
                walk(sub, here, seen | {id(sub)})

    walk(schema, [], frozenset())
    return schema


def undocumented(schema: dict[str, Any]) -> list[str]:
    """The keys of ``schema`` (nested ones too) without a description."""
    defs = schema.get("$defs", {})
    missing: list[str] = []

    def walk(node: dict[str, Any], path: list[str]) -> None:
        for key, prop in node.get("properties", {}).items():
            here = [*path, key]
            ref_node = None
            for cand in (prop, *(prop.get("allOf") or []), *(prop.get("anyOf") or [])):
                ref = cand.get("$ref") or (cand.get("items") or {}).get("$ref")
                if ref:
                    ref_node = defs.get(ref.rsplit("/", 1)[-1])
            if not prop.get("description"):
                missing.append(".".join(here))
            if ref_node is not None:
                walk(ref_node, here)

    walk(schema, [])
    return missing
