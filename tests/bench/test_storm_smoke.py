"""bench/storm.py --quick end to end (50 machines, 5 claims of 10) against a real metald.

Correctness only, never timings: every machine ready, every claim fulfilled, every claimed
machine provisioned, no machine in two claims, and nothing left behind (namespaces, metald).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(
        os.geteuid() != 0, reason="needs root: the storm bench creates network namespaces"
    ),
]


def test_storm_quick(tmp_path: Path) -> None:
    out = tmp_path / "storm.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "storm.py"), "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [res] = json.loads(out.read_text())
    n = res["machines"]
    claims = n // res["claim_size"]
    checks = res["checks"]
    assert res["phase1"]["ready"] == n
    assert res["phase1"]["inventories"] == n
    assert checks["claims_made"] == checks["claims_listed"] == claims
    assert checks["unfulfilled"] == 0
    assert checks["machines_in_two_claims"] == 0
    assert checks["distinct_claimed"] == n
    assert checks["claimed_not_provisioned"] == 0
    assert checks["provisioned_api"] == res["phase2"]["provisioned"] == n
    # Torn down: metald is gone and none of the bench's namespaces remain.
    assert not Path(f"/proc/{res['metald_pid']}").exists()
    ours = (f"mbsrv{res['bench_pid'] % 100000}x", f"mbcli{res['bench_pid'] % 100000}x")
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [ln for ln in left.splitlines() if ln.startswith(ours)], left


@pytest.mark.skipif(
    os.environ.get("METALD_LAB_LONG") != "1",
    reason="a second storm with commissioning (~30-60 s): METALD_LAB_LONG=1; make test keeps test_storm_quick and tests/commissioning/",
)
def test_storm_quick_commissioning(tmp_path: Path) -> None:
    """--machines 10 --commission 1: phase 1 without, then with a commissioning profile (1 s
    of simulated checks); every machine commissioned to ready through metald's verdict."""
    out = tmp_path / "storm.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "storm.py"), "--machines", "10", "--commission",
         "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [(base, com)] = json.loads(out.read_text())
    n = com["machines"]
    assert base["phase1"]["ready"] == com["phase1"]["ready"] == n
    assert base["phase1"]["check_posts"] == 0
    assert com["phase1"]["check_posts"] == 2 * n  # stress-ng, then fio with done
    assert com["phase1"]["commission_overhead_s"]["max"] >= 0
    assert not Path(f"/proc/{com['metald_pid']}").exists()
