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

from _lab import BootProcess, namespaces, set_loop, table, tree_cpu_seconds, write_config

BOOT = """
[boot]
enabled = true
dhcp_mode = "off"
interfaces = ["lo"]
server_address = "127.0.0.1"
tftp_port = {tftp_port}
assets_dir = "{root}"
router_advertisements = false
"""

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
                cfg = write_config(
                    tmp / f"m{n}.toml",
                    state_dir=tmp / f"st{n}",
                    boot=BOOT.format(root=root, tftp_port=6969 + n),
                    listen=f"127.0.0.1:{8090 + n}",
                )
                set_loop(name)
                procs[name] = (BootProcess(lab, cfg, tmp / f"metald{n}.log").start(), 8090 + n)
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
