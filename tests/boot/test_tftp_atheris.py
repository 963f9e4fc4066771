"""Coverage-guided fuzzing of the TFTP core (atheris, libFuzzer) for 3 seconds per run of the
suite; see tftp_atheris.py. The invariants are shared with the hypothesis tests."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

#: Run as a module from the repository root, so it imports the tests' invariants as a package.
ROOT = Path(__file__).resolve().parents[2]


def test_atheris_finds_no_broken_invariant(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.boot.tftp_atheris",
            str(corpus),
            "-max_total_time=3",
            f"-artifact_prefix={tmp_path}/",
            "-rss_limit_mb=1024",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    out = p.stdout + p.stderr
    crashes = sorted(tmp_path.glob("crash-*"))
    assert p.returncode == 0 and not crashes, f"input {crashes}:\n{out[-4000:]}"
    runs = re.search(r"Done (\d+) runs", out)
    assert runs and int(runs.group(1)) > 1000, out[-2000:]
