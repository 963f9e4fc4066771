"""The enrollment storm on a previous tree and on this one, interleaved, in one run: fails
(exit 1) when this tree costs more metald CPU per enrolled machine than the previous one
beyond noise.

    sudo .venv/bin/python bench/storm_compare.py                      # against 9bfe316, 3 rounds
    sudo .venv/bin/python bench/storm_compare.py --base main --rounds 5
    make bench-storm-regress STORM_BASE=main                          # the same, from make

The previous tree is ``git archive REV`` exported to a temp dir; each tree runs its *own*
``bench/storm.py --machines N --enroll-only`` (SQLite), with this venv and ``PYTHONPATH``
pointing at that tree (its metald, api and vmlab; the editable install of this worktree is
found after ``PYTHONPATH``). Rounds alternate the order (old, new / new, old / ...), so a box
that speeds up or slows down during the run tilts both trees alike.

Measured per run: the phase's wall time, metald's CPU per machine (utime + stime from
``/proc``: the figure that holds on a box shared with other work), the SQL statements metald
sent per machine (``bench/sqlcount/sitecustomize.py``, loaded through ``PYTHONPATH`` into the
metald process only: every statement through SQLAlchemy, ``BEGIN`` included, less the ones sent
before the first machine row), the scripts served without a token, DHCP retransmits, and the
1-minute load average before and after. The verdict compares the medians of metald's CPU per
machine: a regression is this tree above ``--threshold`` (1.00) times the previous tree's.
Wall time is printed, never judged (it moves with the box's load). A bench, not a test: it
needs root (network namespaces) and a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SQLCOUNT = HERE / "sqlcount"
#: The end of the first round: 1,000 machines enrolled in 9.8-9.9 s, 9.9 ms of metald CPU each.
DEFAULT_BASE = "9bfe316"


def export(rev: str, into: Path) -> str:
    """``git archive rev`` into ``into``; returns the commit's short id."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", f"{rev}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", sha], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {rev} failed")
    return sha


def run_storm(tree: Path, machines: int, timeout: float, work: Path, tag: str) -> dict[str, Any]:
    """One ``--enroll-only`` run of ``tree``'s own bench; its numbers."""
    out, sql = work / f"{tag}.json", work / f"{tag}.sql.json"
    for p in (out, sql):
        p.unlink(missing_ok=True)
    env = dict(os.environ)
    paths = [str(SQLCOUNT)]
    if tree != ROOT:  # the previous tree's packages first; this worktree's are installed
        paths += [str(tree), str(tree / "vm-lab")]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["STORM_SQLCOUNT"] = str(sql)
    for k in ("STORM_SQLLOG", "STORM_SQLSTACK"):
        env.pop(k, None)
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            str(tree / "bench" / "storm.py"),
            "--machines",
            str(machines),
            "--enroll-only",
            "--json",
            str(out),
            "--timeout",
            str(timeout),
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout + 120,
    )
    if proc.returncode != 0 or not out.exists():
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"{tag}: the storm failed (exit {proc.returncode})")
    r = json.loads(out.read_text())[0]
    p1 = r["phase1"]
    counted = json.loads(sql.read_text()) if sql.exists() else None
    statements = (
        (counted["total"] - counted["startup"]) / machines if counted and counted["total"] else None
    )
    return {
        "wall_s": p1["wall_s"],
        "cpu_ms": 1000 * p1["metald_cpu_s"] / machines,
        "sql": statements,
        "tokenless": p1.get("tokenless_scripts"),
        "retx": p1.get("dhcp_retransmits"),
        "p99_s": p1.get("p99_s"),
        "load": (load0, os.getloadavg()[0]),
        "run_s": time.monotonic() - t0,
    }


def fmt(x: float | None, d: int = 1) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=DEFAULT_BASE, help=f"previous tree (default {DEFAULT_BASE})")
    ap.add_argument(
        "--head",
        help="compare this rev (exported too) instead of the working tree as it is",
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (at least 3)")
    ap.add_argument("--machines", type=int, default=1000)
    ap.add_argument(
        "--threshold",
        type=float,
        default=1.0,
        help="fail when this tree's median CPU per machine exceeds the base's times this",
    )
    ap.add_argument("--timeout", type=float, default=600, help="seconds per storm run")
    ap.add_argument("--json", help="also write every run's numbers here")
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error("--rounds: at least 3 (a median of fewer is noise)")
    if os.geteuid() != 0:
        print("storm_compare.py needs root (the storm creates network namespaces)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="storm-compare-"))
    try:
        old_tree = work / "base"
        old_tree.mkdir()
        sha = export(args.base, old_tree)
        if args.head:
            new_tree = work / "head"
            new_tree.mkdir()
            name = f"this {export(args.head, new_tree)}"
        else:
            new_tree = ROOT
            head = subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
            ).stdout.strip()
            dirty = subprocess.run(
                ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
            ).stdout.strip()
            name = f"this {head}{'+' if dirty else ''}"
        trees = {f"base {sha}": old_tree, name: new_tree}
        print(
            f"storm {args.machines} machines --enroll-only (SQLite), {args.rounds} interleaved "
            f"rounds: {' vs '.join(trees)}",
            flush=True,
        )
        rows: list[dict[str, Any]] = []
        for rnd in range(1, args.rounds + 1):
            order = list(trees.items())
            if rnd % 2 == 0:
                order.reverse()
            for name, tree in order:
                r = run_storm(tree, args.machines, args.timeout, work, f"r{rnd}-{name[:4]}")
                r.update(round=rnd, tree=name)
                rows.append(r)
                print(
                    f"round {rnd} {name:14} wall {r['wall_s']:6.2f} s  metald CPU "
                    f"{r['cpu_ms']:5.2f} ms/machine  SQL {fmt(r['sql'])}/machine  "
                    f"tokenless scripts {r['tokenless'] if r['tokenless'] is not None else '-'}  "
                    f"DHCP retx {r['retx']}  load 1m {r['load'][0]:.1f} -> {r['load'][1]:.1f}",
                    flush=True,
                )
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        med: dict[str, dict[str, float | None]] = {}
        print()
        print("| tree | median wall s | median metald CPU ms/machine | SQL statements/machine |")
        print("|---|---|---|---|")
        for name in trees:
            mine = [r for r in rows if r["tree"] == name]
            sqls = [r["sql"] for r in mine if r["sql"] is not None]
            med[name] = {
                "wall": statistics.median(r["wall_s"] for r in mine),
                "cpu": statistics.median(r["cpu_ms"] for r in mine),
                "sql": statistics.median(sqls) if sqls else None,
            }
            m = med[name]
            print(f"| {name} | {m['wall']:.2f} | {m['cpu']:.2f} | {fmt(m['sql'])} |")
        base, this = (med[n] for n in trees)
        ratio = this["cpu"] / base["cpu"]  # type: ignore[operator]
        verdict = "REGRESSION" if ratio > args.threshold else "ok"
        print(
            f"\nmetald CPU per machine, this / base: {ratio:.2f} (limit {args.threshold:.2f}): "
            f"{verdict}"
        )
        return 1 if ratio > args.threshold else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
