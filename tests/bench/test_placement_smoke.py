"""bench/placement.py runs, every allocator keeps its claims inside one domain, and metald's
rule leaves at least as many whole domains as a random rack choice on the same sequences."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_placement_bench_smoke(capsys) -> None:  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_placement", ROOT / "bench/placement.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.main(["--ops", "100", "--seeds", "10"])
    assert set(out) == {"metald", "rack-first-fit", "rack-random-fit"}
    assert out["metald"]["whole_mean"] >= out["rack-random-fit"]["whole_mean"]
    assert "whole domains free" in capsys.readouterr().out
