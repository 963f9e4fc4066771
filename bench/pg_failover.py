"""PostgreSQL fails over under metald: Patroni (3 etcd members, a primary and a synchronous
standby, deploy/patroni/), two ``metald serve`` instances and a DHCP server on the multi-host
URL, under load (claims, event reads, DORAs); ``kill -9`` of the primary. Several rounds, each
on a fresh cluster.

    sudo .venv/bin/python bench/pg_failover.py                    # 3 rounds, kill the postmaster
    sudo .venv/bin/python bench/pg_failover.py --kill node        # Patroni too: the host is gone
    sudo .venv/bin/python bench/pg_failover.py --kill cut         # nftables cuts the primary's host
    sudo .venv/bin/python bench/pg_failover.py --kill cut --storm 300   # during an enrollment storm

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
long the old primary takes to stream again and whether pg_rewind ran. ``--storm N``: N
simulated machines (bench/storm.py's simulation) enroll against the first instance's boot
plane while the primary is killed or cut (when a third of them are ready): time to all ready,
DHCP retransmits, PXE restarts, HTTP retries, machines held up. With ``--kill cut`` or ``--storm`` the etcd
members run on three hosts of their own, as deploy/patroni/ ships them; ``--etcd-beside`` puts
etcd1 and etcd2 on the PostgreSQL hosts, the layout in which a heal showed Patroni 3.0's split
brain (docs/fleet.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/fleet/test_patroni_failover.py"


def one_round(kill: str, storm: int = 0, etcd_apart: bool = True) -> dict | None:
    test = f"failover_during_enrollment_storm and {kill}" if storm else None
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
            test or f"nothing_acknowledged_lost and {kill}",
        ],
        cwd=ROOT,
        env={
            **os.environ,
            "METALD_LAB_LONG": "1",
            "METALD_PG_FAILOVER_STORM": str(storm),
            "METALD_PG_ETCD_APART": "1" if etcd_apart else "0",
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kill", choices=("postmaster", "node", "cut"), default="postmaster")
    ap.add_argument(
        "--storm", type=int, default=0, metavar="N", help="N simulated machines enroll meanwhile"
    )
    ap.add_argument(
        "--etcd-beside",
        action="store_true",
        help="etcd1 and etcd2 on the PostgreSQL hosts (as shipped before; shows the split brain)",
    )
    args = ap.parse_args()
    if args.storm and args.kill == "node":
        ap.error("--storm runs with --kill postmaster or cut")
    rows = []
    for i in range(args.rounds):
        r = one_round(args.kill, args.storm, not args.etcd_beside)
        load = os.getloadavg()[0]
        if r is None:
            print(f"round {i + 1}: no result (the test's output is above)")
            return 1
        r["load"] = load
        print(f"round {i + 1} (kill {args.kill}, load average {load:.1f}): {json.dumps(r)}")
        rows.append(r)
    storm = f", {args.storm} machines enrolling" if args.storm else ""
    print(
        f"\nkill {args.kill}{storm}, {args.rounds} rounds, 2 metald instances + 1 DHCP server, "
        "fencing age 8 s (heartbeat 2 s, dead after 10 s):"
    )
    print(f"{'':32}{'median':>8}{'max':>8}")
    for name, k in (
        ("kill -> standby promoted (s)", "promoted_s"),
        ("kill -> first 2xx claim (s)", "first_claim_s"),
        ("kill -> first DHCP ACK (s)", "first_ack_s"),
    ):
        xs = [row[k] for row in rows]
        print(f"{name:32}{statistics.median(xs):8.2f}{max(xs):8.2f}")
    print(f"instances fenced (all rounds): {sum(len(r['fenced']) for r in rows)}")
    print(f"acknowledged writes lost (all rounds): {sum(r['lost'] for r in rows)}")
    print(
        "writes sent after the kill and acknowledged by the old primary's last backends "
        f"(all rounds, none lost): {sum(r['orphaned'] for r in rows)}"
    )
    if args.kill == "cut":
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
                f"{row['sync_waits_cancelled']}); old primary took the leader key back after "
                f"the heal: {row['failback']}; acknowledged "
                f"writes missing on it once rejoined: {row['replica_missing']}"
            )
    if args.storm:
        for row in rows:
            print(f"storm: {json.dumps(row['storm'])}")
    loads = ", ".join(f"{r['load']:.1f}" for r in rows)
    print(f"load average (1 min) per round: {loads}")
    ok = all(r["test_passed"] and not r["lost"] and not r["acked_only_on_old"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
