"""What the drawing scripts share: a generated block between two markers of a document,
rewritten in place, or (``--check``) compared and reported stale. Imported by the scripts in
this folder (``python scripts/<name>.py`` puts the folder first on the import path)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def render(doc: str, begin: str, end: str, content: str) -> str:
    """``doc`` with what lies between the ``begin`` and ``end`` markers replaced."""
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{content}\n{end}{tail}"


def main(
    description: str,
    doc_path: Path,
    begin: str,
    end: str,
    draw: Callable[[], str],
    argv: list[str] | None = None,
) -> int:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--check", action="store_true", help="fail when the drawing is stale")
    args = ap.parse_args(argv)
    doc = doc_path.read_text()
    new = render(doc, begin, end, draw())
    if args.check:
        if new != doc:
            print(
                f"{doc_path.name}: the drawing between {begin} and {end} is stale; run {sys.argv[0]}"
            )
            return 1
        return 0
    doc_path.write_text(new)
    return 0
