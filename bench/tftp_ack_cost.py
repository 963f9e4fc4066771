"""CPU of the TFTP server's work per ACK in lock-step, in process (no root, no peers).

    .venv/bin/python bench/tftp_ack_cost.py [--repeats 20] [--blksize 1428]

A client socket and one transfer (``_Transfer`` around ``ReadTransfer``, the shell and core
the server runs) on loopback: the client sends ACK n, the transfer's ``_readable`` is called
directly and timed with the process CPU clock (recvfrom, the machine, sendto, the recvfrom
that ends the drain), then the client reads DATA n+1. Also prints the floor: a bare
recvfrom + sendto of the same sizes. Not a peer comparison (see tftp_bench.py): it isolates
the per-packet Python cost that the 200-client bench cannot separate from the box's load.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import struct
import sys
import time
from pathlib import Path

from metald.boot.tftp.packet import negotiate
from metald.boot.tftp.server import _Transfer
from metald.boot.tftp.transfer import ReadTransfer

IPXE = Path("/usr/lib/ipxe/ipxe.efi")


async def per_ack(data: bytes, blksize: int, repeats: int) -> float:
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
        t = _Transfer(loop, s, m, c.getsockname(), None, lambda *a: None)  # type: ignore[arg-type]
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
    pkt, addr, ack, total = bytes(blksize + 4), s.getsockname(), struct.pack("!HH", 4, 1), 0.0
    for _ in range(n):
        c.sendto(ack, addr)
        t0 = time.process_time()
        _, a = s.recvfrom(2048)
        s.sendto(pkt, a)
        total += time.process_time() - t0
        c.recv(2048)
    return total / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--blksize", type=int, default=1428)
    args = ap.parse_args()
    data = IPXE.read_bytes()
    us = asyncio.run(per_ack(data, args.blksize, args.repeats))
    print(
        f"server work per ACK: {us:.2f} us (CPU); floor recvfrom+sendto: {floor(args.blksize):.2f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
