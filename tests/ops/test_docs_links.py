"""Relative links in the front door and the operator docs lead somewhere (a file, and a heading
for #anchors): the README moved most of its text into docs/ and bench/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/overview.md", "docs/operating.md", "bench/README.md"]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(md: Path) -> set[str]:
    out = set()
    for line in md.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc: str) -> None:
    src = ROOT / doc
    broken = []
    for target in _LINK.findall(src.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (src.parent / path).resolve() if path else src
        missing_anchor = bool(anchor) and dest.suffix == ".md" and anchor not in _anchors(dest)
        if not dest.exists() or missing_anchor:
            broken.append(target)
    assert not broken, f"{doc}: {broken}"


def test_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    for needed in (
        "make demo",
        "make test",
        "docs/operating.md",
        "## Security",
        "<!-- lifecycle:begin -->",
        "<!-- lifecycle:end -->",
    ):
        assert needed in text
    assert len(text.splitlines()) < 200
