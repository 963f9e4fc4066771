"""CPU of the TFTP server's work per ACK in lock-step (no root, no peers).

    .venv/bin/python bench/tftp_ack_cost.py [--repeats 20] [--blksize 1428]
    .venv/bin/python bench/tftp_ack_cost.py --clients 200 [--uvloop]
    ... [--python]   (the TFTP C lock-step loop off: the pure-Python path)
    ... --clients 200 [--no-hub]   (a reader per transfer socket, not the server's hub)

In process (the default): a client socket and one transfer (``_Transfer`` around
``ReadTransfer``, the shell and core the server runs, its socket connected to the client as
the server connects it) on loopback: the client sends ACK n, the transfer's ``_readable`` is
called directly and timed with the process CPU clock (recv, the machine, send, and the recv
that ends the drain), then the client reads DATA n+1. Also prints the floor: a bare recv +
send of the same sizes on connected sockets.

``--clients N``: through the event loop. A ``TftpServer`` in a child process (its own event
loop, asyncio or ``--uvloop``), and N lock-step clients here on raw sockets, each fetching
ipxe.efi (blksize, tsize) until ``--transfers`` fetches are done; prints the server's user and
system CPU per ACK (from /proc), how many times it slept in the event loop, and its wall
time. What it adds to the in-process figure is the event loop's share (the selector, a callback
per ready socket, the timers) and the kernel's wake-ups.

Not a peer comparison (see tftp_bench.py): it isolates the per-packet cost that the
200-client bench cannot separate from the box's load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from metald.boot.tftp.packet import negotiate
from metald.boot.tftp.server import FAST_DRAIN, _Transfer
from metald.boot.tftp.transfer import ReadTransfer

IPXE = Path("/usr/lib/ipxe/ipxe.efi")


async def per_ack(data: bytes, blksize: int, repeats: int, fast: bool) -> float:
    loop = asyncio.get_running_loop()
    total, n = 0.0, 0
    for _ in range(repeats):
        c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        c.bind(("127.0.0.1", 0))
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
        s.connect(c.getsockname())  # as the server does (send and recv, not sendto/recvfrom)
        m = ReadTransfer(data, negotiate({"blksize": str(blksize)}, len(data)))
        t = _Transfer(
            loop,
            s,
            m,
            c.getsockname(),
            None,  # type: ignore[arg-type]
            lambda *a: None,
            FAST_DRAIN if fast else None,
        )
        t.start()
        c.recv(2048)  # the OACK
        addr, blk = s.getsockname(), 0
        while not m.done:
            c.sendto(struct.pack("!HH", 4, blk & 0xFFFF), addr)
            t0 = time.process_time()
            t._readable()
            total += time.process_time() - t0
            n += 1
            if m.done:
                break
            blk = struct.unpack_from("!HH", c.recv(2048))[1]
        t.close()
        c.close()
    return total / n * 1e6


def floor(blksize: int, n: int = 20000) -> float:
    c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    c.bind(("127.0.0.1", 0))
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.setblocking(False)
    s.connect(c.getsockname())
    c.connect(s.getsockname())
    pkt, ack, total = bytes(blksize + 4), struct.pack("!HH", 4, 1), 0.0
    for _ in range(n):
        c.send(ack)
        t0 = time.process_time()
        s.recv(2048)
        s.send(pkt)
        total += time.process_time() - t0
        c.recv(2048)
    return total / n * 1e6


SERVER = """
import asyncio, sys
from metald.boot.tftp.server import TftpServer
async def main():
    s = TftpServer(sys.argv[1], host="127.0.0.1", port=0, max_transfers=2000,
                   max_per_client=2000, fast_ack=sys.argv[3] != "python",
                   hub=sys.argv[3] != "nohub")
    await s.start()
    print(s.bound_port, flush=True)
    await asyncio.Event().wait()
if sys.argv[2] == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""


def _proc_cpu(pid: int) -> tuple[float, float, int]:
    """User and system seconds of ``pid``, and its voluntary context switches (sleeps)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    status = Path(f"/proc/{pid}/status").read_text()
    sleeps = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return int(f[11]) / tick, int(f[12]) / tick, sleeps


def drive(port: int, clients: int, transfers: int, blksize: int) -> tuple[int, int]:
    """``clients`` lock-step fetches of ipxe.efi at a time until ``transfers`` are done;
    returns (ACKs sent, fetches completed)."""
    ep = select.epoll()
    socks: dict[int, socket.socket] = {}
    started = done = acks = 0
    rrq = b"\x00\x01ipxe.efi\x00octet\x00blksize\x00%d\x00tsize\x000\x00" % blksize

    def new() -> None:
        nonlocal started
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setblocking(False)
        s.bind(("127.0.0.1", 0))
        s.sendto(rrq, ("127.0.0.1", port))
        socks[s.fileno()] = s
        ep.register(s.fileno(), select.EPOLLIN)
        started += 1

    for _ in range(min(clients, transfers)):
        new()
    while socks:
        events = ep.poll(10)
        if not events:
            raise SystemExit("the server stopped answering")
        for fd, _ in events:
            s = socks[fd]
            try:
                data, addr = s.recvfrom(4096)
            except BlockingIOError:
                continue
            if data[1] == 6:  # OACK
                s.sendto(b"\x00\x04\x00\x00", addr)
            elif data[1] == 3:
                s.sendto(b"\x00\x04" + data[2:4], addr)
                if len(data) - 4 < blksize:
                    ep.unregister(fd)
                    s.close()
                    del socks[fd]
                    done += 1
                    if started < transfers:
                        new()
            else:
                raise SystemExit(f"unexpected packet {data[:40]!r}")
            acks += 1
    ep.close()
    return acks, done


def through_loop(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "ipxe.efi").write_bytes(IPXE.read_bytes())
        loop_name = "uvloop" if args.uvloop else "asyncio"
        p = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SERVER,
                tmp,
                loop_name,
                "python" if args.python else "nohub" if args.no_hub else "c",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert p.stdout is not None
            port = int(p.stdout.readline())
            u0, s0, z0 = _proc_cpu(p.pid)
            w0 = time.perf_counter()
            acks, done = drive(port, args.clients, args.transfers, args.blksize)
            wall = time.perf_counter() - w0
            u1, s1, z1 = _proc_cpu(p.pid)
        finally:
            p.kill()
            p.wait()
    k = 1e6 / acks
    print(
        f"{loop_name}{' no hub' if args.no_hub else ''}, "
        f"{args.clients} clients, {done} fetches, {acks} ACKs: server CPU per ACK "
        f"{(u1 - u0 + s1 - s0) * k:.2f} us (user {(u1 - u0) * k:.2f}, system "
        f"{(s1 - s0) * k:.2f}); {z1 - z0} sleeps; wall {wall:.2f} s; "
        f"load {os.getloadavg()[0]:.1f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--blksize", type=int, default=1428)
    ap.add_argument("--clients", type=int, default=0, help="through the event loop")
    ap.add_argument("--transfers", type=int, default=200)
    ap.add_argument("--uvloop", action="store_true")
    ap.add_argument("--python", action="store_true", help="the C lock-step loop off")
    ap.add_argument("--no-hub", action="store_true", help="a reader per transfer socket")
    args = ap.parse_args()
    print(f"lock-step ACKs in {'C' if FAST_DRAIN is not None and not args.python else 'Python'}")
    if args.clients:
        through_loop(args)
        return 0
    data = IPXE.read_bytes()
    us = asyncio.run(per_ack(data, args.blksize, args.repeats, not args.python))
    print(f"server work per ACK: {us:.2f} us (CPU); floor recv+send: {floor(args.blksize):.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
