"""The layering rules of docs/architecture.md, checked by import-linter on every test run, and
the doc's import graph, redrawn from the code.

The contracts live in pyproject.toml ([tool.importlinter]); a new import that breaks one fails
here with import-linter's report of the offending chain.
"""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import metald

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
#: Top-level parts of metald that sit beside the layers rather than in them.
OUTSIDE_LAYERS = {"metalctl"}  # an HTTP client of the API: its own contract


def _contracts() -> dict[str, dict]:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in conf["contracts"]}


def test_import_contracts_are_kept() -> None:
    r = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_every_part_of_metald_has_a_layer() -> None:
    """A new module or package under metald/ must be placed in the layers contract (or named
    in OUTSIDE_LAYERS), so the layering covers all of the daemon."""
    named: set[str] = set()
    for layer in _contracts()["layers"]["layers"]:
        named |= {m.strip() for m in re.split(r"[|:]", layer)}
    parts = {
        f"metald.{m.name}"
        for m in pkgutil.iter_modules(metald.__path__)
        if m.name not in OUTSIDE_LAYERS and not m.name.startswith("_")
    }
    missing = sorted(parts - named)
    assert not missing, f"place these in [tool.importlinter] layers (pyproject.toml): {missing}"
    assert not sorted(n for n in named if n.startswith("metald.") and n not in parts)


def test_the_docs_picture_is_drawn_from_the_code() -> None:
    """docs/architecture.md's import graph matches the code (scripts/import_graph.py)."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_graph.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
