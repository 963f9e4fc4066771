"""The store's side of power sync's rounds: per BMC, one transaction (the tree before) against
readings recorded ``RECORD_BATCH`` at a time (this tree), over a fleet whose power did not move
(an idle fleet's steady state: at 10,000 BMCs and a 60 s interval, 167 rounds' worth of BMCs a
second; bench/FLEET.md). The BMCs' answers are a table: what is measured is what a round costs
metald and PostgreSQL after the reads, not the reads (RMCP+ to the BMCs, unchanged).

    .venv/bin/python bench/power_sync_cost.py --bmcs 2500 --rounds 6           # PostgreSQL
    .venv/bin/python bench/power_sync_cost.py --bmcs 2500 --rounds 6 --db sqlite

Prints, per mode (rounds alternated: per-BMC, batched, per-BMC, ...), medians of the rounds:
the round's wall time, metald's CPU (this process), PostgreSQL's CPU (the cluster's processes),
and the transactions and commits metald's engine made, with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "vm-lab")]

from _lab import table, tree_cpu_seconds  # noqa: E402
from sqlalchemy import event  # noqa: E402
from sqlmodel import Session, select  # noqa: E402

from metald.bmc.base import PowerState  # noqa: E402
from metald.bmc.chassis import record_power  # noqa: E402
from metald.bmc.control import Expected  # noqa: E402
from metald.bmc.power_sync import PowerSync  # noqa: E402
from metald.store.db import Store  # noqa: E402
from metald.store.models import Bmc, utcnow  # noqa: E402


class _Control:
    """The executor as power sync uses it: every BMC owned, each answering ``on``."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.ownership = None
        self.instance = "bench"
        self.expected: dict[str, Expected] = {}
        self.cfg = SimpleNamespace(drift_grace_s=120.0)

    async def sync_ownership(self) -> None:
        return None

    def owns(self, row: Bmc) -> bool:
        return True

    async def run(self, row: Bmc, op: str, fn: Any) -> PowerState:
        await asyncio.sleep(0)
        return PowerState.ON


class _PerBmc(PowerSync):
    """The tree before: each reading recorded in a transaction of its own, as it comes back."""

    async def sync_power_once(self) -> int:
        c = self.control
        rows = await c.store.run(lambda s: list(s.exec(_all_bmcs()).all()))

        async def one(row: Bmc) -> bool:
            state = await c.run(row, "sync_power", lambda d: d.get_power())
            r = self.reading(row, state, time.monotonic())
            return await c.store.run(record_power, r.bmc_id, r.observed, r.drift_actor, "bench")

        return sum(await asyncio.gather(*(one(r) for r in rows)))


def _all_bmcs() -> Any:
    return select(Bmc)


def _seed(s: Session, n: int) -> None:
    s.add_all(
        Bmc(
            address=f"10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}",
            protocol="ipmi",
            username="admin",
            password_enc=b"x",
            power_state="on",
            last_seen_at=utcnow(),
        )
        for i in range(n)
    )
    s.commit()


class _Transactions:
    """Transactions and commits metald's engine began and committed (PostgreSQL's own
    ``pg_stat_database`` counters reach it up to a second late, into the next round)."""

    def __init__(self, store: Store) -> None:
        self.begun = self.committed = 0
        event.listen(store.engine, "begin", self._begin)
        event.listen(store.engine, "commit", self._commit)

    def _begin(self, conn: Any) -> None:
        self.begun += 1

    def _commit(self, conn: Any) -> None:
        self.committed += 1


async def _round(sync: PowerSync, tx: _Transactions, postmaster: int | None) -> dict[str, float]:
    before = (tx.begun, tx.committed)
    pg_cpu = tree_cpu_seconds(postmaster) if postmaster else 0.0
    cpu = time.process_time()
    t = time.perf_counter()
    await sync.sync_power_once()
    wall = time.perf_counter() - t
    cpu = time.process_time() - cpu
    pg_cpu = (tree_cpu_seconds(postmaster) if postmaster else 0.0) - pg_cpu
    return {
        "wall": wall,
        "cpu": cpu,
        "pg_cpu": pg_cpu,
        "xacts": tx.begun - before[0],
        "commits": tx.committed - before[1],
    }


async def main_async(args: argparse.Namespace) -> None:
    pg_server = None
    with tempfile.TemporaryDirectory(prefix="metald-psync-") as tmp:
        if args.db == "postgresql":
            from vmlab.pg import PgServer

            pg_server = PgServer()
            url = pg_server.new_database()
        else:
            url = f"sqlite:///{tmp}/metald.db"
        store = Store(url)
        try:
            store.migrate()
            await store.run(_seed, args.bmcs)
            postmaster = (
                int((pg_server.data / "postmaster.pid").read_text().split()[0])
                if pg_server is not None
                else None
            )
            ctl = _Control(store)
            tx = _Transactions(store)
            modes = {
                "per-BMC (before)": _PerBmc(ctl, 60, "metald:bench"),  # type: ignore[arg-type]
                "batched (this tree)": PowerSync(ctl, 60, "metald:bench"),  # type: ignore[arg-type]
            }
            results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
            for sync in modes.values():  # a warm-up round each
                await _round(sync, tx, postmaster)
            for _ in range(args.rounds):
                for name, sync in modes.items():
                    results[name].append(await _round(sync, tx, postmaster))
            load = os.getloadavg()[0]
        finally:
            store.close()
            if pg_server is not None:
                pg_server.stop()
    rows = []
    base = statistics.median(r["cpu"] + r["pg_cpu"] for r in results["per-BMC (before)"])
    for name, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        rows.append(
            [
                name,
                f"{med['wall']:.2f}",
                f"{med['cpu'] * 1e6 / args.bmcs:.0f}",
                f"{med['pg_cpu'] * 1e6 / args.bmcs:.0f}",
                f"{med['xacts']:.0f}",
                f"{med['commits']:.0f}",
                f"{(med['cpu'] + med['pg_cpu']) / base:.2f}",
            ]
        )
    print(
        f"power sync round over {args.bmcs} BMCs, none changed ({args.db}); medians of "
        f"{args.rounds} alternated rounds; 1-minute load average {load:.1f}"
    )
    print(
        table(
            [
                "mode",
                "round wall s",
                "metald CPU us/BMC",
                "PostgreSQL CPU us/BMC",
                "transactions",
                "commits",
                "CPU vs before",
            ],
            rows,
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bmcs", type=int, default=2500)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--db", choices=["postgresql", "sqlite"], default="postgresql")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
