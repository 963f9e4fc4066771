#!/usr/bin/env python3
"""Draw docs/health.md's classification and remediation tables from metald/health.

    .venv/bin/python scripts/health_table.py          # rewrite the tables in docs/health.md
    .venv/bin/python scripts/health_table.py --check  # exit 1 when the doc's are stale

The classification table is ``DEFAULT_RULES`` in order (the first rule that matches decides);
the remediation table is ``TRANSITIONS`` with the action each step performs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import drawn_block

from metald.health.classify import DEFAULT_RULES, TABLE_VERSION
from metald.health.remediation import ACTIONS, HOLDS_SLOT, TRANSITIONS, Step

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "health.md"
RULES = ("<!-- health-rules:begin -->", "<!-- health-rules:end -->")
STEPS = ("<!-- health-steps:begin -->", "<!-- health-steps:end -->")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def rules() -> str:
    lines = [
        f"Table version {TABLE_VERSION}.",
        "",
        "| # | id | kind | code matches | value at least | severity | part | why |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(DEFAULT_RULES, 1):
        value = "" if r.min_value is None else f"{r.min_value:g}"
        lines.append(
            f"| {i} | `{r.id}` | {r.kind.value} | `{_cell(r.match)}` | {value} | "
            f"{r.severity.value} | {r.part} | {_cell(r.why)} |"
        )
    return "\n".join(lines)


def steps() -> str:
    lines = ["| step | action | outcome | next step |", "|---|---|---|---|"]
    order = list(Step)
    for (step, outcome), nxt in sorted(
        TRANSITIONS.items(), key=lambda kv: (order.index(kv[0][0]), order.index(kv[1]))
    ):
        action = ACTIONS[step].value if step in ACTIONS else "-"
        lines.append(f"| {step.value} | {action} | {outcome.value} | {nxt.value} |")
    held = ", ".join(s.value for s in order if s in HOLDS_SLOT)
    lines += ["", f"Steps that hold a claim's and a rack's remediation slot: {held}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    title = __doc__.splitlines()[0]
    rc = drawn_block.main(title, DOC, *RULES, rules, argv)
    return rc or drawn_block.main(title, DOC, *STEPS, steps, argv)


if __name__ == "__main__":
    sys.exit(main())
