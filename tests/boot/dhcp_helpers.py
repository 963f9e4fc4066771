"""Building client packets for tests, with our codec (scapy cross-checks it in test_packet)."""

from __future__ import annotations

from ipaddress import IPv4Address

from metald.boot.dhcp.packet import ZERO, DhcpPacket, MessageType, Opt, mac_to_bytes, serialize


def client_packet(
    mtype: MessageType,
    mac: str = "52:54:00:00:00:01",
    *,
    xid: int = 0x1234,
    options: dict[int, bytes] | None = None,
    ciaddr: IPv4Address = ZERO,
    giaddr: IPv4Address = ZERO,
    flags: int = 0,
) -> DhcpPacket:
    opts = {Opt.MESSAGE_TYPE: bytes((mtype,))}
    opts.update(options or {})
    return DhcpPacket(
        xid=xid, chaddr=mac_to_bytes(mac), ciaddr=ciaddr, giaddr=giaddr, flags=flags, options=opts
    )


def wire(pkt: DhcpPacket) -> bytes:
    return serialize(pkt)


PXE_BIOS = {Opt.VENDOR_CLASS: b"PXEClient:Arch:00000:UNDI:002001", Opt.CLIENT_ARCH: b"\x00\x00"}
PXE_UEFI = {Opt.VENDOR_CLASS: b"PXEClient:Arch:00007:UNDI:003016", Opt.CLIENT_ARCH: b"\x00\x07"}
HTTP_UEFI = {Opt.VENDOR_CLASS: b"HTTPClient:Arch:00016:UNDI:003001", Opt.CLIENT_ARCH: b"\x00\x10"}
IPXE_BIOS = {**PXE_BIOS, Opt.USER_CLASS: b"iPXE"}
