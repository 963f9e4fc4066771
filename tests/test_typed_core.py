"""The typed core type-checks: mypy over the files ``[tool.mypy]`` in pyproject.toml names
(the pure protocol and lifecycle cores, the daemon, its services, ``api.context``).

About 9 s of CPU from cold, 2 s with mypy's cache (``.mypy_cache``); `make lint` runs it too.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_typed_core_names_what_it_must() -> None:
    files = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"])
    must = {
        "metald/daemon.py",
        "metald/service.py",
        "api/context.py",
        "metald/lifecycle.py",
        "metald/bmc/rmcp.py",
        "metald/bmc/sol.py",
        "metald/boot/tftp/packet.py",
        "metald/boot/tftp/transfer.py",
    } | {
        f"metald/boot/dhcp/{m}.py"
        for m in ("packet", "full", "proxy", "common", "bootfile", "leasetable", "balance")
    }
    assert must <= files, sorted(must - files)
    assert all((ROOT / f).is_file() for f in files), [f for f in files if not (ROOT / f).is_file()]


def test_mypy_passes_on_the_typed_core() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
