#!/usr/bin/env python3
"""Write docs/architecture.md's layer table and rule tables from what enforces them.

    .venv/bin/python scripts/architecture_tables.py          # rewrite the tables in the doc
    .venv/bin/python scripts/architecture_tables.py --check  # exit 1 when a table is stale

Three blocks: the layers of the import-linter ``layers`` contract (pyproject.toml), each part
described by the first sentence of its docstring; every import-linter contract with the modules
it holds and forbids (the pure cores among them) and its ignored imports; and the AST tests of
tests/test_architecture.py, each by the first sentence of its docstring. A rule added to the
contracts or the tests shows up in the doc; a doc that is not redrawn fails the test suite.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tomllib
from pathlib import Path

import drawn_block

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
TESTS = ROOT / "tests" / "test_architecture.py"
BLOCKS = ("layer-table", "contracts", "ast-rules")


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _md(text: str) -> str:
    """Docstring text as one markdown table cell (angle brackets outside code escaped)."""
    parts = " ".join(text.replace("``", "`").split()).replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def first_sentence(doc: str | None) -> str:
    """The first sentence of a docstring's first paragraph (one that ends with a colon, which
    introduces a list, ends with a full stop instead)."""
    para = " ".join((doc or "").split("\n\n")[0].split())
    m = re.match(r"(.+?[^.]\.)(\s|$)", para)
    sentence = m.group(1) if m else para
    return _md(sentence[:-1] + "." if sentence.endswith(":") else sentence)


def docstring_of(module: str) -> str | None:
    rel = Path(*module.split("."))
    for path in (ROOT / rel.with_suffix(".py"), ROOT / rel / "__init__.py"):
        if path.exists():
            return ast.get_docstring(ast.parse(path.read_text()))
    return None


def _name(module: str) -> str:
    if module.startswith("metald."):
        return f"`{module.removeprefix('metald.')}`"
    return f"`{module}/`"


def layer_table() -> str:
    layers = next(c for c in contracts() if c["id"] == "layers")["layers"]
    rows = ["| layer | parts | what each part is |", "| --- | --- | --- |"]
    for i, layer in enumerate(layers):
        joined = ":" in layer
        parts = [m.strip() for m in re.split(r"[|:]", layer)]
        names = (" : " if joined else ", ").join(_name(p) for p in parts)
        if joined:
            names += " (may import each other)"
        what = "<br>".join(f"{_name(p)}: {first_sentence(docstring_of(p))}" for p in parts)
        rows.append(f"| {i} | {names} | {what} |")
    return "\n".join(rows)


def _modules(mods: list[str]) -> str:
    return ", ".join(f"`{m}`" for m in mods)


def contract_table() -> str:
    rows = ["| contract | rule | how |", "| --- | --- | --- |"]
    ignored: list[str] = []
    for c in contracts():
        kind = c["type"]
        if kind == "layers":
            how = "the layer table above: a higher layer may import a lower one, never the reverse"
        elif kind == "forbidden":
            how = f"{_modules(c['source_modules'])} never import {_modules(c['forbidden_modules'])}"
            if c.get("allow_indirect_imports"):
                how += " themselves (through another package is allowed)"
        elif kind == "acyclic_siblings":
            how = f"no import cycle among the sibling modules anywhere under {_modules(c['ancestors'])}"
        else:
            how = f"import-linter `{kind}`"
        rows.append(f"| `{c['id']}` | {_md(c['name'])} | {how} |")
        ignored += [f"- `{c['id']}`: `{i}`" for i in c.get("ignore_imports", [])]
    rows += ["", "Ignored imports:", ""]
    rows += ignored or ["- None: every contract holds without an ignored import."]
    return "\n".join(rows)


def ast_rules() -> str:
    tree = ast.parse(TESTS.read_text())
    rows = ["| test | rule |", "| --- | --- |"]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            doc = ast.get_docstring(node)
            rule = first_sentence(doc) if doc else _md(node.name[5:].replace("_", " ").capitalize())
            rows.append(f"| `{node.name}` | {rule} |")
    return "\n".join(rows)


def render(doc: str) -> str:
    for name, draw in zip(BLOCKS, (layer_table, contract_table, ast_rules), strict=True):
        doc = drawn_block.render(doc, f"<!-- {name}:begin -->", f"<!-- {name}:end -->", draw())
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail when a table is stale")
    args = ap.parse_args(argv)
    doc = DOC.read_text()
    missing = [
        b for b in BLOCKS if f"<!-- {b}:begin -->" not in doc or f"<!-- {b}:end -->" not in doc
    ]
    if missing:
        print(f"{DOC.name}: no <!-- NAME:begin/end --> markers for {', '.join(missing)}")
        return 1
    new = render(doc)
    if args.check:
        if new != doc:
            print(f"{DOC.name}: a generated table is stale; run {sys.argv[0]}")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
