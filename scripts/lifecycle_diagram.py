#!/usr/bin/env python3
"""Draw the machine lifecycle into README.md from the table in metald/lifecycle.py.

    .venv/bin/python scripts/lifecycle_diagram.py          # rewrite the diagram in the README
    .venv/bin/python scripts/lifecycle_diagram.py --check  # exit 1 when the README's is stale

A mermaid state diagram with one arrow per (from, to) pair, labelled with its triggers. A
trigger allowed from more than ``WIDE`` states (mark-broken) would bury the picture in arrows: it
is listed under the diagram with the states it leaves, in words.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import drawn_block

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


def main(argv: list[str] | None = None) -> int:
    return drawn_block.main(__doc__.splitlines()[0], DOC, BEGIN, END, diagram, argv)


if __name__ == "__main__":
    sys.exit(main())
