#!/usr/bin/env python3
"""Draw metald's package-level import graph into docs/architecture.md (a mermaid flowchart).

    .venv/bin/python scripts/import_graph.py          # rewrite the picture in the doc
    .venv/bin/python scripts/import_graph.py --check  # exit 1 when the doc's picture is stale

Nodes are metald's top-level modules and packages, and the other root packages (api,
netconfig, bootassets, vmlab); an arrow A --> B means some module of A imports some module of B
(function-level imports included, as import-linter sees them). Nodes are grouped by the layers
of the import-linter contract in pyproject.toml, highest first. Imports of the bare ``metald``
package (only ``__version__``) are left out.
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import drawn_block
import grimp

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- import-graph:begin -->", "<!-- import-graph:end -->"


def contract_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def node_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "metald":
        return parts[0]
    return ".".join(parts[:2]) if len(parts) > 1 else None


def package_edges(roots: list[str]) -> dict[str, set[str]]:
    graph = grimp.build_graph(*roots, cache_dir=None)
    edges: dict[str, set[str]] = defaultdict(set)
    for module in graph.modules:
        a = node_of(module)
        for imported in graph.find_modules_directly_imported_by(module):
            b = node_of(imported)
            if a and b and a != b:
                edges[a].add(b)
    return edges


def _id(node: str) -> str:
    return node.replace(".", "_")


def _label(node: str) -> str:
    return node.removeprefix("metald.") + ("" if node.startswith("metald.") else "/")


def mermaid() -> str:
    conf = contract_config()
    edges = package_edges(conf["root_packages"])
    nodes = set(edges) | {b for bs in edges.values() for b in bs}
    layers = next(c for c in conf["contracts"] if c["id"] == "layers")["layers"]
    lines = ["```mermaid", "flowchart TD"]
    placed: set[str] = set()
    for i, layer in enumerate(layers):
        members = [m.strip() for m in re.split(r"[|:]", layer)]
        lines.append(f'  subgraph L{i}["layer {i}"]')
        lines += [f'    {_id(m)}["{_label(m)}"]' for m in members]
        lines.append("  end")
        placed |= set(members)
    lines += [f'  {_id(n)}["{_label(n)}"]' for n in sorted(nodes - placed)]
    for a in sorted(edges):
        lines += [f"  {_id(a)} --> {_id(b)}" for b in sorted(edges[a])]
    lines.append("```")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return drawn_block.main(__doc__.splitlines()[0], DOC, BEGIN, END, mermaid, argv)


if __name__ == "__main__":
    sys.exit(main())
