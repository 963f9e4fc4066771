"""Every frame on a lab's network, as a tenant on it could see it, and what secrets it carries.

``python -m vmlab.capture OUT.pcap`` run inside a namespace (``ip netns exec``) opens one raw
``AF_PACKET`` socket for every protocol on every interface of that namespace but loopback (the
lab bridge, its taps, the veths of attached namespaces: each port's frames, so a frame
forwarded between two ports is seen on both; loopback is the namespace talking to itself,
metalctl to the staff API for one, never on the wire) and writes each frame to a pcap file
(readable by tcpdump or Wireshark) until SIGTERM. Pure Python: nothing to install (tcpdump is not on these machines).

``secrets_in`` reads such a file back: it joins the TCP payloads of each direction of each
connection in sequence order (a token cut between two segments is found whole) and looks,
there and in every UDP payload, for metald's secrets by their prefixes (agent and API tokens
``mtd_``, join tokens ``mjt_``, node tokens ``mnt_``) and for any exact strings given.
"""

from __future__ import annotations

import re
import signal
import socket
import struct
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ETH_P_ALL = 0x0003
#: metald's secret prefixes (metald.auth, metald.tenants.tokens, metald.tenants.mesh) and the
#: urlsafe base64 of 32 random bytes after them.
TOKEN = re.compile(rb"(?:mtd|mjt|mnt)_[A-Za-z0-9_-]{43}")


def capture(out: Path, ready: Path | None = None) -> int:
    """Write every frame seen in this namespace to ``out`` until SIGTERM or SIGINT; touch
    ``ready`` once the socket is open (frames before that are not seen)."""
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.settimeout(0.2)
    frames = 0
    with open(out, "wb") as f:
        # pcap: magic, v2.4, UTC, accuracy 0, snaplen 262144, link type 1 (Ethernet)
        f.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 262144, 1))
        f.flush()
        if ready is not None:
            ready.touch()
        while not stop:
            try:
                data, where = s.recvfrom(262144)
            except (TimeoutError, InterruptedError):
                continue
            if where[0] == "lo":
                continue
            now = time.time()
            sec = int(now)
            f.write(struct.pack("<IIII", sec, int((now - sec) * 1e6), len(data), len(data)))
            f.write(data)
            frames += 1
            if frames % 64 == 0:
                f.flush()
    s.close()
    return frames


@dataclass
class Found:
    frames: int
    #: TCP connections seen (both directions count once)
    connections: int
    #: bytes of TCP and UDP payload read
    payload_bytes: int
    #: (where, the secret or string) for each one found in clear
    hits: list[tuple[str, bytes]]
    #: TCP ports (either side) that carried any payload
    tcp_ports: set[int]


def frames(path: Path) -> list[bytes]:
    data = path.read_bytes()
    if len(data) < 24 or struct.unpack("<I", data[:4])[0] != 0xA1B2C3D4:
        raise ValueError(f"{path} is not a pcap file of this kind")
    out, i = [], 24
    while i + 16 <= len(data):
        incl = struct.unpack("<I", data[i + 8 : i + 12])[0]
        out.append(data[i + 16 : i + 16 + incl])
        i += 16 + incl
    return out


def secrets_in(path: Path, also: list[bytes] | tuple[bytes, ...] = ()) -> Found:
    """The metald secrets (by prefix) and the strings ``also`` found in clear in the pcap."""
    streams: dict[tuple[str, int, str, int], dict[int, bytes]] = defaultdict(dict)
    udp: list[tuple[str, bytes]] = []
    ports: set[int] = set()
    n = total = 0
    for fr in frames(path):
        n += 1
        if len(fr) < 14:
            continue
        etype, off = struct.unpack("!H", fr[12:14])[0], 14
        if etype == 0x8100 and len(fr) >= 18:  # a VLAN tag
            etype, off = struct.unpack("!H", fr[16:18])[0], 18
        if etype != 0x0800 or len(fr) < off + 20:
            continue
        ihl = (fr[off] & 0x0F) * 4
        proto = fr[off + 9]
        tot = struct.unpack("!H", fr[off + 2 : off + 4])[0]
        src, dst = (
            socket.inet_ntoa(fr[off + 12 : off + 16]),
            socket.inet_ntoa(fr[off + 16 : off + 20]),
        )
        l4 = fr[off + ihl : off + tot]
        if proto == 6 and len(l4) >= 20:
            sport, dport, seq = struct.unpack("!HHI", l4[:8])
            payload = l4[(l4[12] >> 4) * 4 :]
            if payload:
                streams[(src, sport, dst, dport)][seq] = payload
                ports.update((sport, dport))
                total += len(payload)
        elif proto == 17 and len(l4) >= 8:
            sport, dport = struct.unpack("!HH", l4[:4])
            udp.append((f"udp {src}:{sport} -> {dst}:{dport}", l4[8:]))
            total += len(l4) - 8
    hits: list[tuple[str, bytes]] = []

    def scan(where: str, blob: bytes) -> None:
        for m in TOKEN.finditer(blob):
            hits.append((where, m.group(0)))
        for s in also:
            if s and s in blob:
                hits.append((where, s))

    conns = set()
    for (src, sport, dst, dport), segs in streams.items():
        conns.add(frozenset(((src, sport), (dst, dport))))
        scan(f"tcp {src}:{sport} -> {dst}:{dport}", _join(segs))
    for where, payload in udp:
        scan(where, payload)
    return Found(n, len(conns), total, hits, ports)


def _join(segs: dict[int, bytes]) -> bytes:
    """One direction's payload in sequence order (a segment seen twice, on two bridge ports
    or retransmitted, once), wrapping around 2^32."""
    if not segs:
        return b""
    base = min(segs)
    if max(segs) - base > 1 << 31:  # wrapped: count from the highest half
        base = min(s for s in segs if s >= 1 << 31)
    out = bytearray()
    for seq in sorted(segs, key=lambda s: (s - base) % (1 << 32)):
        out += segs[seq]
    return bytes(out)


if __name__ == "__main__":
    capture(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
