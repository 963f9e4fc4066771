"""docs/health.md's tables are drawn from the code (scripts/health_table.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_docs_health_tables_are_drawn_from_the_code() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "health_table.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
