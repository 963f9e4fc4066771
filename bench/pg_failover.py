"""PostgreSQL fails over under metald: Patroni (3 etcd members, a primary and a synchronous
standby, deploy/patroni/), two ``metald serve`` instances and a DHCP server on the multi-host
URL, under load (claims, event reads, DORAs); ``kill -9`` of the primary. Several rounds, each
on a fresh cluster.

    sudo .venv/bin/python bench/pg_failover.py                    # 3 rounds, kill the postmaster
    sudo .venv/bin/python bench/pg_failover.py --kill node        # Patroni too: the host is gone
    sudo .venv/bin/python bench/pg_failover.py --kill cut         # nftables cuts the primary's host
    sudo .venv/bin/python bench/pg_failover.py --kill partition   # cut from etcd and metald only
    sudo .venv/bin/python bench/pg_failover.py --kill cut --storm 300   # during an enrollment storm
    sudo .venv/bin/python bench/pg_failover.py --storm 300 --kill postmaster,cut,none --rounds 3

Each round is one run of the long test (tests/fleet/test_patroni_failover.py, the scenario in
tests/fleet/pg_failover.py; benches import no test module, so it runs as a pytest process and
its ``PG_FAILOVER_JSON`` line is read): the test checks nothing acknowledged was lost, this
prints the times. Per round: seconds from the kill to the standby's promotion, to the first
2xx claim through metald's API and to the first DHCP ACK answered after the promotion was
seen; which instances fenced themselves (fencing age: ``dead_after_s - heartbeat_s`` = 8 s at
metald's defaults); acknowledged writes lost (must be 0). The load average is printed with
them: timings on a busy box are longer than on a quiet one.

``--kill cut``: every database host and metald instance in a network namespace of its own, and
the primary's host cut off by nftables (everything dropped but loopback), its processes alive;
besides the above: when the old primary stopped taking writes, rows on it that are not on the
new primary (and how many of them were acknowledged: must be 0), then, once the cut heals, how
long the old primary takes to stream again and whether pg_rewind ran. ``--kill partition``:
the same cut, but the primary's host still reaches the standby's (replication goes on), so the
standby sees the old primary alive while the leader key runs out. ``--storm N``: N
simulated machines (bench/storm.py's simulation) enroll against the first instance's boot
plane while the primary is killed or cut (when a third of them are ready): time to all ready,
DHCP retransmits, PXE restarts, HTTP retries, machines held up; ``--kill none`` is the storm
alone, the baseline. Several kinds (``--kill postmaster,cut,none``) run interleaved, one of
each per round, so that each kind's cost is a difference against the baseline under the same
load on the box. With ``--kill cut`` or ``--storm`` the etcd
members run on three hosts of their own, as deploy/patroni/ ships them; ``--etcd-beside`` puts
etcd1 and etcd2 on the PostgreSQL hosts, the layout in which a heal showed Patroni 3.0's split
brain (docs/fleet.md). ``--dcs JSON`` lays Patroni settings over the shipped ``bootstrap.dcs``
(``--kill partition --dcs '{"failsafe_mode": true}'``: no failover at all, docs/fleet.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/fleet/test_patroni_failover.py"


def one_round(
    kill: str, storm: int = 0, etcd_apart: bool = True, dcs: str = ""
) -> dict[str, Any] | None:
    test = f"failover_during_enrollment_storm and {kill}]" if storm else None
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            TEST,
            "-k",
            test or f"nothing_acknowledged_lost and {kill}]",
        ],
        cwd=ROOT,
        env={
            **os.environ,
            "METALD_LAB_LONG": "1",
            "METALD_PG_FAILOVER_STORM": str(storm),
            "METALD_PG_ETCD_APART": "1" if etcd_apart else "0",
            "METALD_PG_DCS": dcs,
        },  # fmt: skip
        capture_output=True,
        text=True,
        timeout=900,
    )
    for line in r.stdout.splitlines():
        if line.startswith("PG_FAILOVER_JSON "):
            out = json.loads(line.split(" ", 1)[1])
            out["test_passed"] = r.returncode == 0
            return out
    failed = [x for x in r.stdout.splitlines() if x.startswith(("E ", "FAILED"))]
    print("\n".join(failed) or r.stdout[-3000:], r.stderr[-2000:], file=sys.stderr)
    return None


KINDS = ("postmaster", "node", "cut", "partition", "none")
CUTS = ("cut", "partition")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--kill",
        default="postmaster",
        help=f"one of {', '.join(KINDS)}, or several joined by commas (run interleaved)",
    )
    ap.add_argument(
        "--storm", type=int, default=0, metavar="N", help="N simulated machines enroll meanwhile"
    )
    ap.add_argument(
        "--etcd-beside",
        action="store_true",
        help="etcd1 and etcd2 on the PostgreSQL hosts (as shipped before; shows the split brain)",
    )
    ap.add_argument(
        "--dcs",
        default="",
        metavar="JSON",
        help="laid over the shipped bootstrap.dcs, e.g. '{\"failsafe_mode\": true}'",
    )
    args = ap.parse_args()
    if args.dcs:
        json.loads(args.dcs)
    kinds = args.kill.split(",")
    if any(k not in KINDS for k in kinds):
        ap.error(f"--kill takes {', '.join(KINDS)}")
    if args.storm and ("node" in kinds or "partition" in kinds):
        ap.error("--storm runs with --kill postmaster, cut or none")
    if "none" in kinds and not args.storm:
        ap.error("--kill none is the storm's baseline: give --storm N")
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for i in range(args.rounds):
        for kill in kinds:  # interleaved: each kind meets the box's load in turn
            r = one_round(kill, args.storm, not args.etcd_beside, args.dcs)
            load = os.getloadavg()
            if r is None:
                print(f"round {i + 1}, kill {kill}: no result (the test's output is above)")
                return 1
            r["load"] = load[0]
            r["loadavg"] = load
            print(
                f"round {i + 1} (kill {kill}, load average {load[0]:.1f} {load[1]:.1f} "
                f"{load[2]:.1f}): {json.dumps(r)}",
                flush=True,
            )
            rows[kill].append(r)
    ok = True
    for kill in kinds:
        ok = report(kill, rows[kill], args.storm) and ok
    if args.storm and "none" in kinds and len(kinds) > 1:
        base = statistics.median(r["storm"]["wall_s"] for r in rows["none"])
        print(f"\nstorm cost of each failover (median all-ready time minus the baseline's, "
              f"{base:.2f} s):")  # fmt: skip
        for kill in kinds:
            if kill != "none":
                med = statistics.median(r["storm"]["wall_s"] for r in rows[kill])
                # Paired: each round's failover against the baseline run right after it.
                diffs = [
                    f["storm"]["wall_s"] - n["storm"]["wall_s"]
                    for f, n in zip(rows[kill], rows["none"], strict=True)
                ]
                print(
                    f"  {kill:12} {med:8.2f} s  ({med - base:+.2f} s); per round, against that "
                    f"round's baseline: {', '.join(f'{d:+.2f}' for d in diffs)} s (median "
                    f"{statistics.median(diffs):+.2f} s)"
                )
    return 0 if ok else 1


def report(kill: str, rows: list[dict[str, Any]], storm: int) -> bool:
    what = f", {storm} machines enrolling" if storm else ""
    print(
        f"\nkill {kill}{what}, {len(rows)} rounds, 2 metald instances + 1 DHCP server, "
        "fencing age 8 s (heartbeat 2 s, dead after 10 s):"
    )
    if kill != "none":
        print(f"{'':36}{'median':>8}{'max':>8}")
        for name, k in (
            ("kill -> standby promoted (s)", "promoted_s"),
            ("kill -> first 2xx claim (s)", "first_claim_s"),
            ("kill -> first DHCP ACK (s)", "first_ack_s"),
        ):
            xs = [row[k] for row in rows]
            print(f"{name:36}{statistics.median(xs):8.2f}{max(xs):8.2f}")
    print(f"instances fenced (all rounds): {sum(len(r['fenced']) for r in rows)}")
    print(f"acknowledged writes lost (all rounds): {sum(r['lost'] for r in rows)}")
    print(
        "writes sent after the kill and acknowledged by the old primary's last backends "
        f"(all rounds, none lost): {sum(r['orphaned'] for r in rows)}"
    )
    if kill in CUTS:
        for name, k in (
            ("cut -> old primary not writable (s)", "demoted_s"),
            ("heal -> old primary streams (s)", "rejoined_s"),
        ):
            xs = [row[k] for row in rows if row[k] is not None]
            if xs:
                print(f"{name:36}{statistics.median(xs):8.2f}{max(xs):8.2f}")
        for row in rows:
            print(
                f"old primary at the heal: {row['old_state']}; rows only on it: "
                f"{row['only_on_old']} (acknowledged: {row['acked_only_on_old']}); packets the "
                f"cut dropped: {row['cut_dropped']}; pg_rewind: {row['rewound']} (commits that "
                f"waited for the standby, cancelled on the old primary: "
                f"{row['sync_waits_cancelled']}); two primaries when the promotion was seen: "
                f"{row['both_primary']}; the new leader's Patroni waited on the old primary: "
                f"{row['waited']}; old primary took the leader key back after "
                f"the heal: {row['failback']}; acknowledged "
                f"writes missing on it once rejoined: {row['replica_missing']}"
            )
    if storm:
        for row in rows:
            print(f"storm: {json.dumps(row['storm'])}")
        if rows:
            for name, k in (("power-on -> all ready (s)", "wall_s"), ("p99 (s)", "p99_s")):
                xs = [row["storm"][k] for row in rows]
                print(f"storm {name:30}{statistics.median(xs):8.2f}{max(xs):8.2f}")
    loads = ", ".join("/".join(f"{x:.1f}" for x in r["loadavg"]) for r in rows)
    print(f"load average (1/5/15 min) after each round: {loads}")
    return all(
        r["test_passed"] and not r["lost"] and not r["acked_only_on_old"] and not r["both_primary"]
        for r in rows
    )


if __name__ == "__main__":
    sys.exit(main())
