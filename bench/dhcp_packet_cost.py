"""In-process cost of one DORA in metald's DHCP shell: CPU per DORA with no perfdhcp, no
veth, no other process (what the code changes, not the box's load).

The shell's own receive path (``_drain``) reads perfdhcp-like relayed DISCOVERs, then the
REQUESTs for the offers, from a real UDP socket on loopback, in polls of ``--batch`` packets
(4,000 DORA/s at the 4 ms poll interval: ~16 DISCOVERs and 16 REQUESTs a poll); the leases
go to a real SQLite store (group commit, ACKs sent from the commit callback) and the replies
to a loopback socket that this harness drains. Reported: process CPU (user+sys) per DORA
spent in the server's calls (the drains and the commit, with their recvfrom and sendto;
not the harness building and sending the client packets), median of ``--repeat`` runs. ``--profile`` prints cProfile's top functions instead.

    .venv/bin/python bench/dhcp_packet_cost.py --doras 20000 --batch 16 --repeat 5
    .venv/bin/python bench/dhcp_packet_cost.py --tree /tmp/old   # `git archive main | tar -x -C /tmp/old`
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import socket
import statistics
import sys
import tempfile
import time
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

# --tree PATH: measure the metald source tree at PATH (before/after comparisons). This script
# runs again from PATH through `python -c`, whose first import path is the working directory:
# metald comes from that tree, not from the installed one.
if "--tree" in sys.argv and __name__ == "__main__":
    _at = sys.argv.index("--tree")
    _tree, _rest = sys.argv[_at + 1], sys.argv[1:_at] + sys.argv[_at + 2 :]
    os.chdir(_tree)
    _code = f"import runpy, sys; sys.argv = {[__file__, *_rest]!r}; "
    _code += f"runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"
    os.execv(sys.executable, [sys.executable, "-c", _code])

from metald.boot.dhcp.bootfile import BootFiles  # noqa: E402
from metald.boot.dhcp.common import NetworkPlan  # noqa: E402
from metald.boot.dhcp.lease_store import LeaseStore  # noqa: E402
from metald.boot.dhcp.packet import DhcpPacket, MessageType, Opt, parse, serialize  # noqa: E402
from metald.boot.dhcp.server import DhcpServer  # noqa: E402
from metald.store.db import Store  # noqa: E402

LO = IPv4Address("127.0.0.1")
#: What perfdhcp -4 sends (its default template): type, parameter request list; relayed.
PRL = bytes((1, 28, 2, 3, 15, 6, 12))


def _client(mtype: MessageType, i: int, extra: dict[int, bytes]) -> bytes:
    mac = bytes((0x52, 0x54, (i >> 24) & 0xFF, (i >> 16) & 0xFF, (i >> 8) & 0xFF, i & 0xFF))
    opts = {Opt.MESSAGE_TYPE: bytes((mtype,)), Opt.PARAM_REQUEST: PRL, **extra}
    return serialize(DhcpPacket(xid=i, hops=1, chaddr=mac, giaddr=LO, options=opts))


async def run(doras: int, batch: int, db: Path, batch_io: bool = True) -> list[float]:
    store = Store(f"sqlite:///{db}")
    store.migrate()
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    sink.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    sink.setblocking(False)
    srv = DhcpServer(
        mode="full",
        interfaces=["lo"],
        networks=[
            NetworkPlan(
                name="lo",
                subnet=IPv4Network("127.0.0.0/8"),
                pool_start=IPv4Address("127.1.0.0"),
                pool_end=IPv4Address("127.3.255.255"),
                lease_seconds=3600,
            )
        ],
        server_id=LO,
        files=BootFiles(http_base="http://127.0.0.1:1"),
        leases=LeaseStore(store),
        port=0,
        bind_host="127.0.0.1",
        relay_port=sink.getsockname()[1],
        batch_io=batch_io,
    )
    await srv.start()
    lst = srv._listeners[0]
    srv.poll_interval = 0  # this harness drives the drains itself
    asyncio.get_running_loop().remove_reader(lst.sock.fileno())
    lst.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    addr = lst.sock.getsockname()
    feed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    discovers = [_client(MessageType.DISCOVER, i, {}) for i in range(doras)]
    acks = 0
    cpu = [0.0, 0.0, 0.0]  # DISCOVER drains, REQUEST drains, commits (with their ACKs)
    clock = time.process_time
    for lo in range(0, doras, batch):
        for d in discovers[lo : lo + batch]:
            feed.sendto(d, addr)
        t0 = clock()
        srv._drain(lst)
        cpu[0] += clock() - t0
        offers = []
        try:
            while True:
                offers.append(parse(sink.recv(2048)))
        except BlockingIOError:
            pass
        for o in offers:
            i = o.xid
            req = {Opt.REQUESTED_IP: o.yiaddr.packed, Opt.SERVER_ID: LO.packed}
            feed.sendto(_client(MessageType.REQUEST, i, req), addr)
        t0 = clock()
        srv._drain(lst)
        t1 = clock()
        await srv.leases.drain()  # type: ignore[union-attr]
        t2 = clock()
        cpu[1] += t1 - t0
        cpu[2] += t2 - t1
        try:
            while True:
                sink.recv(2048)
                acks += 1
        except BlockingIOError:
            pass
    assert acks == doras, f"{acks} ACKs for {doras} DORAs"
    await srv.stop()
    srv.leases.close()  # type: ignore[union-attr]
    store.close()
    return [c / doras * 1e6 for c in cpu]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doras", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--io",
        choices=["batch", "single", "both"],
        default="batch",
        help="recvmmsg/sendmmsg (the C extension), recvfrom/sendto, or both alternated",
    )
    ap.add_argument("--tree", help="import metald from this source tree instead")
    args = ap.parse_args()
    if args.io == "both":
        # Alternated run by run, each reported apart (the same box load for both).
        totals: dict[bool, list[float]] = {True: [], False: []}
        for k in range(args.repeat):
            for io in (True, False):
                with tempfile.TemporaryDirectory() as d:
                    parts3 = asyncio.run(run(args.doras, args.batch, Path(d) / "m.db", io))
                totals[io].append(sum(parts3))
                print(
                    f"run {k + 1} {'batch ' if io else 'single'}: {sum(parts3):.1f} us CPU per"
                    f" DORA ({' / '.join(f'{p:.1f}' for p in parts3)})"
                )
        b, s1 = statistics.median(totals[True]), statistics.median(totals[False])
        print(f"median: batch {b:.1f}, single {s1:.1f} us/DORA ({b / s1:.2f}x)")
        return 0
    results = []
    for k in range(args.repeat):
        with tempfile.TemporaryDirectory() as d:
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                asyncio.run(run(args.doras, args.batch, Path(d) / "m.db", args.io != "single"))
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
                return 0
            results.append(
                asyncio.run(run(args.doras, args.batch, Path(d) / "m.db", args.io == "batch"))
            )
        d, r, c = results[-1]
        print(
            f"run {k + 1}: {d + r + c:.1f} us CPU per DORA: DISCOVER->OFFER {d:.1f},"
            f" REQUEST (decide, queue) {r:.1f}, commit + ACK {c:.1f}"
        )
    parts = [statistics.median(x[i] for x in results) for i in range(3)]
    total = statistics.median(sum(x) for x in results)
    print(
        f"median {total:.1f} us/DORA over {len(results)} runs (parts: "
        + " / ".join(f"{p:.1f}" for p in parts)
        + ")"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
