"""A DHCP client on a provisioning segment, driven over stdin (run in a network namespace by
tests/fleet/test_partition.py; argument: the interface). Each input line is a JSON request; each answer a JSON line.

{"op": "discover", "mac": M, "window": s}: broadcast a DISCOVER (broadcast flag set) and list
every OFFER heard within the window: [{"server": server id, "yiaddr": address}].
{"op": "request", "mac": M, "ip": A, "server": S, "window": s}: a REQUEST selecting S's offer
(or renewing A when server is null); the answers: [{"server", "type": "ack"|"nak", "yiaddr"}].
"""

from __future__ import annotations

import json
import random
import select
import socket
import sys
import time
from ipaddress import IPv4Address

from metald.boot.dhcp.packet import (
    DhcpPacket,
    MalformedPacket,
    MessageType,
    Op,
    Opt,
    mac_to_bytes,
    parse,
    serialize,
)


def _send_and_collect(sock: socket.socket, pkt: DhcpPacket, window: float) -> list[dict]:
    sock.sendto(serialize(pkt), ("255.255.255.255", 67))
    out: list[dict] = []
    end = time.monotonic() + window
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([sock], [], [], left)
        if not ready:
            break
        data, _ = sock.recvfrom(4096)
        try:
            got = parse(data)
        except MalformedPacket:
            continue
        if got.op != Op.REPLY or got.xid != pkt.xid or got.chaddr[:6] != pkt.chaddr[:6]:
            continue
        sid = got.options.get(Opt.SERVER_ID)
        mt = got.message_type
        out.append(
            {
                "server": str(IPv4Address(sid)) if sid else None,
                "type": mt.name.lower() if mt is not None else None,
                "yiaddr": str(got.yiaddr),
            }
        )
    return out


def main() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
    # Broadcasts leave by this interface (the namespace has no default route).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, sys.argv[1].encode())
    sock.bind(("0.0.0.0", 68))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        opts = {Opt.MESSAGE_TYPE: bytes((MessageType.DISCOVER,))}
        ciaddr = IPv4Address(0)
        if req["op"] == "request":
            opts = {Opt.MESSAGE_TYPE: bytes((MessageType.REQUEST,))}
            if req.get("server"):
                opts[Opt.SERVER_ID] = IPv4Address(req["server"]).packed
                opts[Opt.REQUESTED_IP] = IPv4Address(req["ip"]).packed
            else:
                opts[Opt.REQUESTED_IP] = IPv4Address(req["ip"]).packed
        pkt = DhcpPacket(
            xid=random.getrandbits(32),
            chaddr=mac_to_bytes(req["mac"]),
            ciaddr=ciaddr,
            flags=0x8000,
            options=opts,
        )
        print(json.dumps(_send_and_collect(sock, pkt, float(req.get("window", 1.0)))), flush=True)


if __name__ == "__main__":
    main()
