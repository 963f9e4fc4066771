"""ProxyDHCP (PXE spec 2.1): someone else hands out addresses; metald only says what to boot.

Port 67: a PXE client's DISCOVER gets an OFFER with no address (yiaddr 0), vendor class
PXEClient, option 43 and the boot file. Port 4011: the client's unicast REQUEST gets an ACK
with the boot file, sent back where it came from. Clients that do not network-boot are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Address

from metald.boot.dhcp.bootfile import BootFiles, classify
from metald.boot.dhcp.common import (
    Decision,
    NetworkPlan,
    add_boot,
    destination,
    echo_relay_info,
    pxe_vendor_options,
    reply_skeleton,
)
from metald.boot.dhcp.packet import ZERO, DhcpPacket, MessageType, Opt


@dataclass
class ProxyHandler:
    server_id: IPv4Address
    files: BootFiles

    def handle(
        self,
        pkt: DhcpPacket,
        net: NetworkPlan | None,
        src: tuple[str, int],
        *,
        on_proxy_port: bool,
    ) -> Decision:
        name = net.name if net else None
        kind = classify(pkt)
        if not kind.boots:
            return Decision(ignored="not-booting", network=name, kind=kind)
        mtype = pkt.message_type
        if on_proxy_port:
            if mtype not in (MessageType.REQUEST, MessageType.INFORM):
                return Decision(ignored="not-a-boot-request", network=name, kind=kind)
            reply = self._boot_reply(pkt, MessageType.ACK, kind)
            reply.ciaddr = pkt.ciaddr
            # Sent back to the client's own address and port (it already has an address).
            host = str(pkt.ciaddr) if pkt.ciaddr != ZERO else src[0]
            return Decision(reply=reply, dest=(host, src[1]), network=name, kind=kind)
        if mtype is MessageType.DISCOVER:
            reply = self._boot_reply(pkt, MessageType.OFFER, kind)
            return Decision(reply=reply, dest=destination(pkt, reply), network=name, kind=kind)
        if mtype is MessageType.REQUEST and pkt.server_id == self.server_id:
            reply = self._boot_reply(pkt, MessageType.ACK, kind)
            return Decision(reply=reply, dest=destination(pkt, reply), network=name, kind=kind)
        return Decision(ignored="not-for-proxy", network=name, kind=kind)

    def _boot_reply(self, pkt: DhcpPacket, mtype: MessageType, kind: object) -> DhcpPacket:
        reply = reply_skeleton(pkt, mtype, self.server_id)
        add_boot(reply, kind, pkt.mac, self.files, self.server_id)  # type: ignore[arg-type]
        # A proxy reply must say PXEClient or firmware ignores it (HTTPClient likewise). Full
        # mode must NOT say it: EDK2 then takes the offer as "BINL" and asks port 4011 again.
        reply.options.setdefault(Opt.VENDOR_CLASS, b"PXEClient")
        if reply.options[Opt.VENDOR_CLASS] == b"PXEClient":
            reply.options[Opt.VENDOR_SPECIFIC] = pxe_vendor_options()
        if Opt.CLIENT_UUID in pkt.options:
            reply.options[Opt.CLIENT_UUID] = pkt.options[Opt.CLIENT_UUID]
        echo_relay_info(pkt, reply)
        return reply
