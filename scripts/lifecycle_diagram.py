#!/usr/bin/env python3
"""Draw the machine lifecycle into README.md from the table in metald/lifecycle.py.

    .venv/bin/python scripts/lifecycle_diagram.py          # rewrite the diagram in the README
    .venv/bin/python scripts/lifecycle_diagram.py --check  # exit 1 when the README's is stale

A mermaid state diagram with one arrow per (from, to) pair, labelled with its triggers. A
trigger allowed from more than ``WIDE`` states (mark-broken) would bury the picture in arrows: it
is listed under the diagram with the states it leaves, in words.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from metald.lifecycle import TRANSITIONS, State, Trigger, sources

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "README.md"
BEGIN, END = "<!-- lifecycle:begin -->", "<!-- lifecycle:end -->"
#: Triggers allowed from more states than this are written out, not drawn.
WIDE = 8


def _id(state: State) -> str:
    return state.name.lower()


def diagram() -> str:
    wide = [t for t in Trigger if len(sources(t)) > WIDE]
    arrows: dict[tuple[State, State], list[str]] = defaultdict(list)
    for (src, trigger), target in TRANSITIONS.items():
        if trigger not in wide:
            arrows[(src, target)].append(trigger.value)
    lines = ["```mermaid", "stateDiagram-v2"]
    lines += [f"  {_id(s)}: {s.value}" for s in State]
    lines.append(f"  [*] --> {_id(State.DISCOVERED)}")
    order = list(State)
    for src, target in sorted(arrows, key=lambda k: (order.index(k[0]), order.index(k[1]))):
        lines.append(f"  {_id(src)} --> {_id(target)}: {', '.join(arrows[(src, target)])}")
    lines.append("```")
    for t in wide:
        targets = {TRANSITIONS[(s, t)] for s in sources(t)}
        others = sorted(s.value for s in set(State) - sources(t))
        to = ", ".join(sorted(s.value for s in targets))
        lines.append("")
        lines.append(f"`{t.value}` (not drawn): from every state but {', '.join(others)}, to {to}.")
    return "\n".join(lines)


def render(doc: str) -> str:
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{diagram()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail when the README's diagram is stale")
    args = ap.parse_args(argv)
    doc = DOC.read_text()
    new = render(doc)
    if args.check:
        if new != doc:
            print(f"{DOC.relative_to(ROOT)}: the lifecycle diagram is stale; run {sys.argv[0]}")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
