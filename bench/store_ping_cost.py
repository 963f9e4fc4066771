"""What testing every pooled connection before use costs a transaction: SQLAlchemy's
``pool_pre_ping`` (the tree before) against metald's test of connections idle for
``PING_IDLE_S`` only (``metald.store.db.ping_when_idle``), on PostgreSQL, with the store's
thread pool under load as in a storm (8 threads, each transaction a primary-key read and a
small update, as most of the enrollment's are).

    .venv/bin/python bench/store_ping_cost.py --transactions 4000 --rounds 5

Rounds alternate the two engines on one database; medians: wall time, metald's CPU (this
process) and PostgreSQL's (the postmaster and its backends) per transaction, and the
round-trips the pool's tests made. Prints the 1-minute load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "vm-lab")]

from _lab import table, tree_cpu_seconds  # noqa: E402
from sqlalchemy import create_engine, update  # noqa: E402
from sqlmodel import Session  # noqa: E402

from metald.machines import create_machine  # noqa: E402
from metald.store.db import Store  # noqa: E402
from metald.store.models import Machine  # noqa: E402


def _work(s: Session, mid: str, k: int) -> None:
    m = s.get(Machine, mid)
    assert m is not None
    s.execute(update(Machine).where(Machine.id == mid).values(rack_position=f"u{k}"))  # type: ignore[arg-type]
    s.commit()


async def _round(store: Store, ids: list[str], n: int, postmaster: int) -> dict[str, float]:
    pings = [0]
    real = store.engine.dialect.do_ping

    def counted(c: Any) -> bool:
        pings[0] += 1
        return real(c)

    store.engine.dialect.do_ping = counted  # type: ignore[method-assign]
    pg0, cpu0, t0 = tree_cpu_seconds(postmaster), time.process_time(), time.perf_counter()
    sem = asyncio.Semaphore(64)

    async def one(k: int) -> None:
        async with sem:
            await store.run(_work, ids[k % len(ids)], k)

    await asyncio.gather(*(one(k) for k in range(n)))
    wall = time.perf_counter() - t0
    out = {
        "wall": wall,
        "cpu": (time.process_time() - cpu0) / n * 1e6,
        "pg": (tree_cpu_seconds(postmaster) - pg0) / n * 1e6,
        "pings": pings[0],
    }
    store.engine.dialect.do_ping = real  # type: ignore[method-assign]
    return out


async def main_async(args: argparse.Namespace) -> None:
    from vmlab.pg import PgServer

    pg = PgServer()
    try:
        url = pg.new_database(template=pg.migrated_template())
        postmaster = int((pg.data / "postmaster.pid").read_text().split()[0])
        idle = Store(url)
        before = Store(url)
        before.engine.dispose()
        u = before.engine.url
        before.engine = create_engine(
            u,
            pool_size=10,
            max_overflow=20,
            pool_pre_ping=True,
            connect_args={"connect_timeout": 5},
        )
        ids = await idle.run(
            lambda s: [
                create_machine(s, macs=[f"52:54:00:00:{i // 256:02x}:{i % 256:02x}"], actor="b").id
                for i in range(200)
            ]
        )
        modes = {"pool_pre_ping (before)": before, "tested when idle (this tree)": idle}
        res: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        for store in modes.values():
            await _round(store, ids, args.transactions // 4, postmaster)  # warm-up
        for _ in range(args.rounds):
            for name, store in modes.items():
                res[name].append(await _round(store, ids, args.transactions, postmaster))
        load = os.getloadavg()[0]
        idle.close()
        before.close()
    finally:
        pg.stop()
    base = statistics.median(r["cpu"] + r["pg"] for r in res["pool_pre_ping (before)"])
    rows = []
    for name, rs in res.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        rows.append(
            [
                name,
                f"{med['wall']:.2f}",
                f"{med['cpu']:.0f}",
                f"{med['pg']:.0f}",
                f"{med['pings']:.0f}",
                f"{(med['cpu'] + med['pg']) / base:.2f}",
            ]
        )
    print(
        f"{args.transactions} transactions a round (8 store threads), medians of {args.rounds} "
        f"alternated rounds; 1-minute load average {load:.1f}"
    )
    print(
        table(
            [
                "pool",
                "round wall s",
                "metald CPU us/tx",
                "PostgreSQL CPU us/tx",
                "tests (round-trips)",
                "CPU vs before",
            ],
            rows,
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transactions", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=5)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
