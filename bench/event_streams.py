"""Event streams: what N open /api/v1/events/stream connections cost the server.

    .venv/bin/python bench/event_streams.py [--streams 200] [--seconds 20] [--src DIR]

Starts the API (SQLite, loopback) in a child process from the metald source in ``--src``
(default: this checkout; pass an export of an older commit to compare), opens N streams spread
over tokens of 8 streams each, then for ``--seconds`` measures the server process's CPU (from
/proc) and the latency of ``GET /api/v1/machines`` asked every 100 ms, while a technician
changes a machine's state every second (every stream must receive every change).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

SERVER = r"""
import asyncio, inspect, json, sys
from aiohttp import web
from api.app import create_app
from api.context import AppContext
from metald.auth import issue_token
from metald.config import load_config
from metald.events import EventBus
from metald import machines
from metald.lifecycle import Trigger
from metald.secrets import SecretBox
from metald.store import Store

state, n_tokens = sys.argv[1], int(sys.argv[2])
async def main():
    cfg = load_config(None, environ={"METALD_STATE_DIR": state,
                                     "METALD_STORE__URL": f"sqlite:///{state}/metald.db"})
    store = Store(cfg.store_url)
    store.migrate()
    with store.session() as s:
        tokens = [issue_token(s, name=f"o{i}", role="technician")[1] for i in range(n_tokens)]
        m = machines.create_machine(s, macs=["02:00:00:00:00:01"], actor="bench")
        machines.transition(s, m.id, Trigger.INSPECT, actor="bench")
        machines.transition(s, m.id, Trigger.INSPECTED, actor="bench",
                            updates={"inventory": {"schema_version": 1}})
    bus = EventBus(max_streams=100000) if "max_streams" in inspect.signature(EventBus).parameters else EventBus()
    ctx = AppContext(cfg=cfg, store=store, secrets=SecretBox.from_file(cfg.secrets_key_path), bus=bus)
    runner = web.AppRunner(create_app(ctx), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(json.dumps({"port": runner.addresses[0][1], "tokens": tokens, "machine": m.id}), flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(args: argparse.Namespace) -> dict[str, float]:
    state = tempfile.mkdtemp(prefix="metald-bench-streams-")
    per_token = 8
    n_tokens = max(1, -(-args.streams // per_token)) + 1
    # ``python -c`` puts its working folder first on the import path: the server runs the
    # metald of args.src (this tree, or an old checkout to compare with).
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, state, str(n_tokens)],
        stdout=subprocess.PIPE,
        cwd=args.src,
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        base = f"http://127.0.0.1:{info['port']}"
        tech = {"Authorization": f"Bearer {info['tokens'][-1]}"}
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as http:
            r = await http.get(f"{base}/api/v1/events", headers=tech)
            cursor = (await r.json())["next_after"]
            received = [0] * args.streams

            async def stream(i: int) -> None:
                h = {"Authorization": f"Bearer {info['tokens'][i // per_token]}"}
                async with http.get(
                    f"{base}/api/v1/events/stream?after={cursor}", headers=h, timeout=None
                ) as s:
                    assert s.status == 200, await s.text()
                    async for line in s.content:
                        if line.startswith(b"data:"):
                            received[i] += 1

            tasks = [asyncio.create_task(stream(i)) for i in range(args.streams)]
            latencies: list[float] = []
            changes = 0

            async def probe() -> None:
                while True:
                    t0 = time.perf_counter()
                    r = await http.get(f"{base}/api/v1/machines", headers=tech)
                    await r.read()
                    latencies.append(time.perf_counter() - t0)
                    await asyncio.sleep(0.1)

            async def change() -> None:
                nonlocal changes
                actions = ["maintenance-on", "maintenance-off"]
                while True:
                    r = await http.post(
                        f"{base}/api/v1/machines/{info['machine']}/actions",
                        json={"action": actions[changes % 2]},
                        headers=tech,
                    )
                    assert r.status == 200, await r.text()
                    changes += 1
                    await asyncio.sleep(1)

            await asyncio.sleep(3)  # let every stream connect
            c0, t0 = cpu_seconds(proc.pid), time.monotonic()
            side = [asyncio.create_task(probe()), asyncio.create_task(change())]
            await asyncio.sleep(args.seconds)
            cpu = (cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0)
            for t in side:
                t.cancel()
            await asyncio.sleep(2)  # the last change reaches the streams
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, *side, return_exceptions=True)
        latencies.sort()
        return {
            "streams": args.streams,
            "server_cpu_pct": round(100 * cpu, 1),
            "latency_p50_ms": round(1000 * statistics.median(latencies), 1),
            "latency_p95_ms": round(1000 * latencies[int(0.95 * (len(latencies) - 1))], 1),
            "latency_max_ms": round(1000 * latencies[-1], 1),
            "probes": len(latencies),
            "changes": changes,
            "streams_with_every_change": sum(1 for n in received if n >= changes),
        }
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--src", type=Path, default=Path(__file__).resolve().parent.parent)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
