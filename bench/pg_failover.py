"""PostgreSQL fails over under metald: Patroni (3 etcd members, a primary and a synchronous
standby, deploy/patroni/), two ``metald serve`` instances and a DHCP server on the multi-host
URL, under load (claims, event reads, DORAs); ``kill -9`` of the primary. Several rounds, each
on a fresh cluster (tests/fleet/pg_failover.py has the scenario and what is measured).

    sudo .venv/bin/python bench/pg_failover.py                    # 3 rounds, kill the postmaster
    sudo .venv/bin/python bench/pg_failover.py --kill node        # Patroni too: the host is gone

Printed per round: seconds from the kill to the standby's promotion, to the first 2xx claim
through metald's API and to the first DHCP ACK answered after the promotion was seen; which instances fenced themselves (fencing age:
``dead_after_s - heartbeat_s`` = 8 s at metald's defaults); acknowledged writes lost (must be
0). The load average is printed with them: timings on a busy box are longer than on a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "vm-lab")]

from tests.fleet.patroni_lab import available  # noqa: E402
from tests.fleet.pg_failover import failover_round  # noqa: E402


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kill", choices=("postmaster", "node"), default="postmaster")
    ap.add_argument("--instances", type=int, default=2)
    args = ap.parse_args()
    # The in-process DHCP server's warnings while the store is away: counted, not printed.
    logging.getLogger("metald").setLevel(logging.ERROR)
    why = available()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    rows = []
    for i in range(args.rounds):
        relay = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        relay.bind(("127.0.0.1", 0))
        relay.setblocking(False)
        try:
            with tempfile.TemporaryDirectory(prefix="metald-pgfo-") as tmp:
                r = await failover_round(Path(tmp), relay, instances=args.instances, kill=args.kill)
        finally:
            relay.close()
        load = os.getloadavg()[0]
        print(f"round {i + 1} (kill {args.kill}, load average {load:.1f}): {r.summary()}")
        lost = len(r.lost_leases) + len(r.lost_claims) + len(r.lost_events)
        rows.append(
            (r.promoted_s, r.first_claim_s, r.first_ack_s, len(r.fenced), lost, load, r.orphaned)
        )
    print(
        f"\nkill {args.kill}, {args.rounds} rounds, {args.instances} metald instances + 1 DHCP "
        f"server, fencing age 8 s (heartbeat 2 s, dead after 10 s):"
    )
    print(f"{'':32}{'median':>8}{'max':>8}")
    for name, k in (
        ("kill -> standby promoted (s)", 0),
        ("kill -> first 2xx claim (s)", 1),
        ("kill -> first DHCP ACK (s)", 2),
    ):
        xs = [row[k] for row in rows]
        print(f"{name:32}{statistics.median(xs):8.2f}{max(xs):8.2f}")
    print(f"instances fenced (all rounds): {sum(r[3] for r in rows)}")
    print(f"acknowledged writes lost (all rounds): {sum(r[4] for r in rows)}")
    print(
        "writes sent after the kill and acknowledged by the old primary's last backends "
        f"(all rounds, none lost): {sum(r[6] for r in rows)}"
    )
    print(f"load average (1 min) per round: {', '.join(f'{r[5]:.1f}' for r in rows)}")
    return 1 if any(r[4] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
