"""Server CPU per small HTTP request (aiohttp's request path), metald on asyncio vs uvloop.

    sudo .venv/bin/python bench/http_request_cost.py [--requests 5000] [--rounds 4]

Both run in one network namespace on loopback (``python -m metald.boot``, HTTP boot routes
only); a client makes N GETs of a 512-byte boot asset, 50 at a time, against each in turn,
interleaved rounds; server CPU (utime + stime from /proc) per request. Used for the event-loop
evaluation in BOOT.md: it weighs the request path (parse, route, handler, response headers)
more than sendfile does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _lab import BootProcess, namespaces, start_http_metald, table, tree_cpu_seconds

DRIVER = r"""
import asyncio, sys, time, aiohttp
n, url = int(sys.argv[1]), sys.argv[2]
async def main():
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=50)) as s:
        async def one():
            async with s.get(url) as r:
                await r.read()
                return r.status
        t0 = time.perf_counter()
        st = await asyncio.gather(*[one() for _ in range(n)])
        print(f"{time.perf_counter() - t0:.3f} {sum(x != 200 for x in st)}")
asyncio.run(main())
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    names = ["metald-asyncio", "metald-uvloop"]
    cpu: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp_s, namespaces("api") as ns:
        tmp = Path(tmp_s)
        root = tmp / "assets"
        root.mkdir()
        (root / "x").write_bytes(b"y" * 512)
        lab = ns["api"]
        procs: dict[str, tuple[BootProcess, int]] = {}
        try:
            for n, name in enumerate(names):
                procs[name] = start_http_metald(lab, tmp, n, name, root)
            for rnd in range(args.rounds):
                for name, (bp, port) in procs.items():
                    pid = bp.proc.pid  # type: ignore[union-attr]
                    c0 = tree_cpu_seconds(pid)
                    url = f"http://127.0.0.1:{port}/boot/assets/x"
                    r = lab.run(sys.executable, "-c", DRIVER, str(args.requests), url, timeout=300)
                    us = (tree_cpu_seconds(pid) - c0) / args.requests * 1e6
                    wall, bad = r.stdout.split()
                    cpu[name].append(us)
                    print(f"round {rnd} {name}: {wall} s, {bad} failed, {us:.0f} us/request")
        finally:
            for bp, _ in procs.values():
                bp.stop()
    ref = statistics.median(cpu["metald-asyncio"])
    rows = [
        [
            n,
            " ".join(f"{c:.0f}" for c in v),
            f"{statistics.median(v):.0f}",
            f"{statistics.median(v) / ref:.2f}",
        ]
        for n, v in cpu.items()
    ]
    print(f"\n{args.requests} GETs of a 512-byte asset, 50 at a time, {args.rounds} rounds")
    print(table(["server", "us/request per round", "median", "vs asyncio"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
