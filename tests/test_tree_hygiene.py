"""The repository tracks no leftovers of a merge or a patch (``*.orig``, ``*.rej``): such a
file is a stale copy of code that reviews and searches then read as if it were live."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_merge_or_patch_leftovers_are_tracked() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", "*.orig", "*.rej"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    leftovers = [p for p in listed.split("\0") if p]
    assert leftovers == [], f"remove these merge/patch leftovers (git rm): {leftovers}"
