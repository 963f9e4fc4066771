"""A minimal DHCP relay-side client for durability tests: DORA for N MACs through "a relay"
(giaddr = our address, port 67), printing each ACKed ``mac ip`` as soon as it arrives.

Run inside a namespace: ``python relay_client.py SERVER LOCAL COUNT``.
"""

from __future__ import annotations

import socket
import sys

from metald.boot.dhcp.packet import (
    DhcpPacket,
    MalformedPacket,
    MessageType,
    Opt,
    mac_to_bytes,
    parse,
    serialize,
)


def main() -> None:
    server, local, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    from ipaddress import IPv4Address

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((local, 67))
    s.settimeout(0.5)

    def exchange(pkt: DhcpPacket, want: MessageType) -> DhcpPacket | None:
        for _ in range(4):
            s.sendto(serialize(pkt), (server, 67))
            try:
                while True:
                    r = parse(s.recvfrom(2048)[0])
                    if r.xid == pkt.xid and r.message_type in (want, MessageType.NAK):
                        return r
            except (TimeoutError, MalformedPacket):
                continue
            except OSError:
                return None
        return None

    for i in range(count):
        mac = f"02:00:00:{i >> 16 & 255:02x}:{i >> 8 & 255:02x}:{i & 255:02x}"
        base = dict(chaddr=mac_to_bytes(mac), giaddr=IPv4Address(local), hops=1)
        d = DhcpPacket(xid=2 * i + 1, options={Opt.MESSAGE_TYPE: b"\x01"}, **base)
        off = exchange(d, MessageType.OFFER)
        if off is None or off.message_type is not MessageType.OFFER:
            continue
        r = DhcpPacket(
            xid=2 * i + 2,
            options={
                Opt.MESSAGE_TYPE: b"\x03",
                Opt.REQUESTED_IP: off.yiaddr.packed,
                Opt.SERVER_ID: off.options[Opt.SERVER_ID],
            },
            **base,
        )
        ack = exchange(r, MessageType.ACK)
        if ack is not None and ack.message_type is MessageType.ACK:
            print(mac, ack.yiaddr, flush=True)


if __name__ == "__main__":
    main()
