"""What full and proxy mode share: per-network plans, network choice, reply skeletons and
RFC 2131 section 4.1 reply addressing. Pure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from socket import inet_ntoa  # str(IPv4Address) is ~10x slower on the hot path
from typing import NamedTuple

from metald.boot.dhcp.bootfile import BootFiles, ClientKind, boot_file_for
from metald.boot.dhcp.leasetable import LeaseRecord
from metald.boot.dhcp.packet import (
    BROADCAST_FLAG,
    ZERO,
    DhcpPacket,
    MessageType,
    Op,
    Opt,
    RelaySub,
    encode_tlv,
)
from metald.macaddr import normalize_mac

CLIENT_PORT = 68
SERVER_PORT = 67
LIMITED_BROADCAST = IPv4Address("255.255.255.255")
_BROADCAST_STR = str(LIMITED_BROADCAST)


@dataclass
class NetworkPlan:
    """One provisioning network with everything a reply needs precomputed."""

    name: str
    subnet: IPv4Network
    pool_start: IPv4Address
    pool_end: IPv4Address
    lease_seconds: int
    interface: str = ""
    router: IPv4Address | None = None
    dns: list[IPv4Address] = field(default_factory=list)
    reservations: dict[str, IPv4Address] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.reservations = {normalize_mac(k): v for k, v in self.reservations.items()}
        self.reserved = frozenset(self.reservations.values())
        self.base_options: dict[int, bytes] = {Opt.SUBNET_MASK: self.subnet.netmask.packed}
        if self.router:
            self.base_options[Opt.ROUTER] = self.router.packed
        if self.dns:
            self.base_options[Opt.DNS] = b"".join(a.packed for a in self.dns)
        # Precomputed for the hot path: the subnet as an int range, the lease time options.
        self._net_lo = int(self.subnet.network_address)
        self._net_hi = int(self.subnet.broadcast_address)
        self._pool_lo, self._pool_hi = int(self.pool_start), int(self.pool_end)
        t = self.lease_seconds
        self.lease_options: dict[int, bytes] = {
            Opt.LEASE_TIME: t.to_bytes(4, "big"),
            Opt.RENEWAL_TIME: (t // 2).to_bytes(4, "big"),
            Opt.REBINDING_TIME: (t * 7 // 8).to_bytes(4, "big"),
        }

    def contains(self, ip: IPv4Address) -> bool:
        """``ip in self.subnet``, without IPv4Network's generic checks."""
        return self._net_lo <= int(ip) <= self._net_hi

    @classmethod
    def from_config(cls, net: object) -> NetworkPlan:
        return cls(
            name=net.name,  # type: ignore[attr-defined]
            subnet=net.subnet,  # type: ignore[attr-defined]
            pool_start=net.pool_start,  # type: ignore[attr-defined]
            pool_end=net.pool_end,  # type: ignore[attr-defined]
            lease_seconds=net.lease_seconds,  # type: ignore[attr-defined]
            interface=net.interface,  # type: ignore[attr-defined]
            router=net.router,  # type: ignore[attr-defined]
            dns=list(net.dns),  # type: ignore[attr-defined]
            reservations=dict(net.reservations),  # type: ignore[attr-defined]
        )

    def in_pool(self, ip: IPv4Address) -> bool:
        return self._pool_lo <= int(ip) <= self._pool_hi

    def assignable(self, ip: IPv4Address, mac: str) -> bool:
        """May ``mac`` hold ``ip`` here (ignoring other clients' leases)?"""
        if self.reservations:
            reserved = self.reservations.get(mac)
            if reserved is not None:
                return ip == reserved
            return self.in_pool(ip) and ip not in self.reserved
        return self._pool_lo <= int(ip) <= self._pool_hi


class Decision(NamedTuple):
    """What to do with one packet: a value the shell applies. ``puts`` go into the lease table
    at once (in order); ``reply`` waits for ``write`` to commit when there is one; if the write
    loses a race with another instance, ``on_conflict`` is sent instead. A tuple: immutable,
    and cheaper to build than a frozen dataclass on the hot path."""

    reply: DhcpPacket | None = None
    dest: tuple[str, int] | None = None
    write: LeaseRecord | None = None
    extra_writes: tuple[LeaseRecord, ...] = ()
    on_conflict: Callable[[], DhcpPacket | None] | None = None
    #: Metric label when nothing is sent: why.
    ignored: str | None = None
    network: str | None = None
    kind: ClientKind | None = None
    #: Records for the in-memory lease table (offers, bindings, ended leases), in order.
    puts: tuple[LeaseRecord, ...] = ()


def choose_network(
    pkt: DhcpPacket, interface: str, networks: list[NetworkPlan]
) -> NetworkPlan | None:
    """Relay link selection (option 82 sub-option 5), else giaddr, else the receiving
    interface. A network not configured for that path is never answered on."""
    gi = pkt.giaddr
    if gi is not ZERO and gi != ZERO:
        link = gi
        if Opt.RELAY_AGENT in pkt.options:
            ra = pkt.relay_agent
            if ra and len(ra.get(RelaySub.LINK_SELECTION, b"")) == 4:
                link = IPv4Address(ra[RelaySub.LINK_SELECTION])
        for net in networks:
            if net.contains(link):
                return net
        return None
    direct = [n for n in networks if n.interface and n.interface == interface]
    if len(direct) > 1 and pkt.ciaddr != ZERO:
        for net in direct:
            if pkt.ciaddr in net.subnet:
                return net
    return direct[0] if direct else None


_MTYPE_BYTES = {t: bytes((t,)) for t in MessageType}
_NAK = _MTYPE_BYTES[MessageType.NAK]
#: giaddr/ciaddr (as int: IPv4Address hashes in Python) -> dotted string for sendto; the
#: same few relays in every packet. Bounded.
_DOTTED: dict[int, str] = {}
#: The server id last packed (one per server): (address, its bytes).
_SID: tuple[IPv4Address, bytes] = (ZERO, b"\x00" * 4)


def _dotted(a: IPv4Address) -> str:
    n = int(a)
    s = _DOTTED.get(n)
    if s is None:
        if len(_DOTTED) >= 4096:
            _DOTTED.clear()
        s = _DOTTED[n] = inet_ntoa(a.packed)
    return s


def _sid_bytes(server_id: IPv4Address) -> bytes:
    global _SID
    if _SID[0] is not server_id:
        _SID = (server_id, server_id.packed)
    return _SID[1]


def reply_skeleton(req: DhcpPacket, mtype: MessageType, server_id: IPv4Address) -> DhcpPacket:
    opts: dict[int, bytes] = {
        Opt.MESSAGE_TYPE: _MTYPE_BYTES[mtype],
        Opt.SERVER_ID: _sid_bytes(server_id),
    }
    # Positional, in DhcpPacket's field order: op htype hlen hops xid secs flags ciaddr yiaddr
    # siaddr giaddr chaddr sname file options.
    return DhcpPacket(
        Op.REPLY,
        req.htype,
        req.hlen,
        0,
        req.xid,
        0,
        req.flags,
        ZERO,
        ZERO,
        ZERO,
        req.giaddr,
        req.chaddr,
        b"",
        b"",
        opts,
    )


def add_boot(
    reply: DhcpPacket,
    kind: ClientKind,
    mac: str,
    files: BootFiles,
    server: IPv4Address,
) -> bool:
    """Put the boot file (and next-server) in ``reply``. False if the client gets none."""
    if not (kind.pxe or kind.http or kind.ipxe):
        return False  # not network-booting: boot_file_for would say None
    bootfile = boot_file_for(kind, mac, files)
    if bootfile is None:
        return False
    raw = bootfile.encode()
    reply.siaddr = server
    if len(raw) <= 127:
        reply.file = raw
    reply.options[Opt.BOOTFILE] = raw
    if kind.http:
        reply.options[Opt.VENDOR_CLASS] = b"HTTPClient"
    return True


#: iPXE's encapsulated options (option 175) with sub-option 176 "no-pxedhcp" = 1: the offer
#: already names the boot script, so iPXE requests at once instead of waiting 2 s for ProxyDHCP
#: offers; a ProxyDHCP answer from anyone else on the segment then has nothing to race.
IPXE_ENCAP = 175
IPXE_NO_PXEDHCP = bytes((176, 1, 1))


def echo_relay_info(req: DhcpPacket, reply: DhcpPacket) -> None:
    """RFC 3046: the server copies option 82 back, last, for the relay to strip."""
    v = req.options.get(Opt.RELAY_AGENT)
    if v is not None:
        reply.options.pop(Opt.RELAY_AGENT, None)
        reply.options[Opt.RELAY_AGENT] = v


def destination(req: DhcpPacket, reply: DhcpPacket) -> tuple[str, int]:
    """RFC 2131 4.1. A server with no raw socket cannot unicast to an address the client
    does not have yet; 4.1 allows broadcasting then."""
    nak = reply.options.get(Opt.MESSAGE_TYPE) == _NAK
    gi = req.giaddr
    if gi is not ZERO and gi != ZERO:
        if nak:
            reply.flags |= BROADCAST_FLAG
        return _dotted(gi), SERVER_PORT
    if nak:
        return _BROADCAST_STR, CLIENT_PORT
    ci = req.ciaddr
    if ci is not ZERO and ci != ZERO:
        return _dotted(ci), CLIENT_PORT
    return _BROADCAST_STR, CLIENT_PORT


def pxe_vendor_options() -> bytes:
    """Option 43 for PXE clients: discovery control 8 = boot the file named in this packet,
    no boot server discovery or menu (PXE 2.1 spec)."""
    return encode_tlv({6: b"\x08"}) + b"\xff"
