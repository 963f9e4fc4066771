"""bench/fleet.py --quick end to end: 1 metald x 40 machines, then 3 x 40 on one PostgreSQL
with a kill -9 of one instance mid-storm.

Correctness only, never timings: every machine ready in both runs (3 x 40 despite the kill,
but for any whose armed boot the killed instance took without answering: counted, stranded),
each simulated BMC read by exactly one instance in every window (counted at the BMCs), the
killed instance's BMCs held by the survivors, and nothing left behind (metald processes,
namespaces).
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
        os.geteuid() != 0, reason="needs root: the fleet bench creates network namespaces"
    ),
]


@pytest.mark.skipif(
    os.environ.get("METALD_LAB_LONG") != "1",
    reason="two fleet benches with a kill -9 (~1-3 min): METALD_LAB_LONG=1; make test keeps tests/fleet/",
)
def test_fleet_quick(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fleet.py"), "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, three = json.loads(out.read_text())
    assert (one["instances"], three["instances"]) == (1, 3)
    assert one["stranded"] == []  # nothing was killed
    assert len(three["stranded"]) <= three["takeover"]["victim_clients"]
    for r in (one, three):
        n = r["machines"]
        # Ready, or stranded: its script was fetched from the killed instance just before the
        # kill, so its one armed boot is gone (it waits for inspecting_timeout_s; reported).
        assert r["ready_api"] == r["ready_store"] == n - len(r["stranded"])
        for w in (r["window_before"], r["window_after"]):
            assert (w["once"], w["more"], w["none"]) == (n, 0, 0), w
        # Every BMC held by a live instance, none by the killed one.
        assert sum(r["bmcs_held_after"].values()) == n
        for pid in r["pids"]:
            assert not Path(f"/proc/{pid}").exists()
    # Three instances shared the BMCs before the kill; two read them all after it.
    assert len(three["window_before"]["bmcs_per_reader"]) == 3
    assert len(three["window_after"]["bmcs_per_reader"]) == 2
    t = three["takeover"]
    assert t["victim"] == "rack1" and t["victim_bmcs"] > 0
    assert "rack1" not in three["bmcs_held_after"]
    assert set(three["bmcs_held_after"]) == {"rack0", "rack2"}
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for r in (one, three):
        assert not [ln for ln in left.splitlines() if ln.split()[0] in r["namespaces"]], left
