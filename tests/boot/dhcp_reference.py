"""The DHCP codec and full-mode decision core as they were before the per-packet work of
2026-12-03 (issue 18), kept verbatim as references: test_dhcp_equivalence checks that the
faster code gives the same bytes, packets and decisions on random input. Not used by metald."""

# ruff: noqa
from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Address

from metald.boot.dhcp.bootfile import BootFiles, classify
from metald.boot.dhcp.common import (
    IPXE_ENCAP,
    IPXE_NO_PXEDHCP,
    Decision,
    NetworkPlan,
    add_boot,
    destination,
    echo_relay_info,
    reply_skeleton,
)
from metald.boot.dhcp.leasetable import LeaseRecord, LeaseState, LeaseTable
from metald.boot.dhcp.packet import (
    HEADER_LEN,
    MAGIC_COOKIE,
    MAX_PACKET,
    ZERO,
    DhcpPacket,
    MalformedPacket,
    MessageType,
    Opt,
    _ENCODED,
    _HEADER,
    _MESSAGE_TYPES,
    _addr,
    _encoded,
    _packed,
)


def _parse_options(data: bytes, out: dict[int, bytes], *, where: str) -> None:
    i, n = 0, len(data)
    while i < n:
        code = data[i]
        if code == Opt.PAD:
            i += 1
            continue
        if code == Opt.END:
            return
        if i + 1 >= n:
            raise MalformedPacket("truncated-option", f"{where}: option {code} has no length")
        length = data[i + 1]
        end = i + 2 + length
        if end > n:
            raise MalformedPacket(
                "truncated-option",
                f"{where}: option {code} claims {length} bytes, {n - i - 2} left",
            )
        prev = out.get(code)
        out[code] = data[i + 2 : end] if prev is None else prev + data[i + 2 : end]
        i = end
    # No END: tolerated (some ROMs pad the packet with zeros instead).


def parse(data: bytes) -> DhcpPacket:
    """Decode one DHCPv4 datagram. Raises ``MalformedPacket``."""
    if len(data) > MAX_PACKET:
        raise MalformedPacket("oversized", f"{len(data)} bytes")
    if len(data) < HEADER_LEN:
        raise MalformedPacket("truncated-header", f"{len(data)} bytes")
    if data[236:240] != MAGIC_COOKIE:
        raise MalformedPacket("no-magic-cookie")
    (op, htype, hlen, hops, xid, secs, flags, ci, yi, si, gi, chaddr, sname, file) = (
        _HEADER.unpack_from(data)
    )
    if op not in (1, 2):
        raise MalformedPacket("bad-op", str(op))
    if hlen > 16:
        raise MalformedPacket("bad-hlen", str(hlen))
    options: dict[int, bytes] = {}
    _parse_options(data[HEADER_LEN:], options, where="options")
    overload = options.pop(Opt.OVERLOAD, None)
    if overload is not None:
        # Options continued in the file and/or sname fields. Those fields are parsed once
        # each and an OVERLOAD inside them is ignored, so overload cannot loop.
        if len(overload) != 1 or overload[0] not in (1, 2, 3):
            raise MalformedPacket("bad-overload", repr(overload))
        if overload[0] & 1:
            _parse_options(file, options, where="file")
            file = b""
        if overload[0] & 2:
            _parse_options(sname, options, where="sname")
            sname = b""
        options.pop(Opt.OVERLOAD, None)
    # Positional: field order of DhcpPacket (keywords cost measurably per packet).
    pkt = DhcpPacket(
        op,
        htype,
        hlen,
        hops,
        xid,
        secs,
        flags,
        _addr(ci),
        _addr(yi),
        _addr(si),
        _addr(gi),
        chaddr,
        sname.split(b"\x00", 1)[0] if sname[:1] != b"\x00" else b"",
        file.split(b"\x00", 1)[0] if file[:1] != b"\x00" else b"",
        options,
    )
    # Validates option 53 now, so handlers can trust it.
    mt = options.get(Opt.MESSAGE_TYPE)
    if mt is not None and mt not in _MESSAGE_TYPES:
        raise MalformedPacket("bad-message-type", repr(mt))
    return pkt


def _encode_option(code: int, value: bytes) -> bytes:
    # Values over 255 bytes are split into several instances of the option (RFC 3396).
    if len(value) <= 255:
        return bytes((code, len(value))) + value
    return b"".join(
        bytes((code, len(value[i : i + 255]))) + value[i : i + 255]
        for i in range(0, len(value), 255)
    )


def serialize(pkt: DhcpPacket, *, min_size: int = 300) -> bytes:
    """Encode a packet. Message type goes first (some ROMs expect it there); the result is
    padded to ``min_size`` because old BOOTP relays and clients drop shorter datagrams."""
    if len(pkt.sname) > 63 or len(pkt.file) > 127:
        raise ValueError("sname or file too long for the fixed fields")
    chaddr = pkt.chaddr
    parts = [
        _HEADER.pack(
            pkt.op,
            pkt.htype,
            pkt.hlen,
            pkt.hops,
            pkt.xid,
            pkt.secs,
            pkt.flags,
            _packed(pkt.ciaddr),
            _packed(pkt.yiaddr),
            _packed(pkt.siaddr),
            _packed(pkt.giaddr),
            chaddr if len(chaddr) == 16 else chaddr.ljust(16, b"\x00")[:16],
            pkt.sname,
            pkt.file,
        ),
        MAGIC_COOKIE,
    ]
    opts = pkt.options
    mt = opts.get(Opt.MESSAGE_TYPE)
    if mt is not None:
        parts.append(_encoded(Opt.MESSAGE_TYPE, mt))
    cache = _ENCODED
    for code, value in opts.items():
        if code != Opt.MESSAGE_TYPE:
            try:
                enc = cache.get((code, value))  # what replies repeat; _encoded fills the cache
            except TypeError:  # an unhashable value (bytearray)
                enc = None
            parts.append(enc if enc is not None else _encoded(code, value))
    parts.append(b"\xff")
    out = b"".join(parts)
    return out if len(out) >= min_size else out + bytes(min_size - len(out))


#: How long an offered address is held for the client's REQUEST.
OFFER_HOLD_SECONDS = 30
#: How long after its ACK a binding may be declined (the client's ARP probe takes seconds).
DECLINE_SECONDS = 60


@dataclass
class FullHandler:
    server_id: IPv4Address
    files: BootFiles

    def handle(self, pkt: DhcpPacket, net: NetworkPlan, table: LeaseTable, now: float) -> Decision:
        """``decide``, then apply its records to ``table`` (what the shell does)."""
        d = self.decide(pkt, net, table, now)
        if d.puts:
            table.apply(d.puts)
        return d

    def decide(self, pkt: DhcpPacket, net: NetworkPlan, table: LeaseTable, now: float) -> Decision:
        """The decision for one packet. Reads ``table``, never changes it."""
        mtype = pkt.message_type
        if mtype is MessageType.DISCOVER:
            return self._discover(pkt, net, table, now)
        if mtype is MessageType.REQUEST:
            return self._request(pkt, net, table, now)
        if mtype is MessageType.DECLINE:
            return self._decline(pkt, net, table, now)
        if mtype is MessageType.RELEASE:
            return self._release(pkt, net, table, now)
        if mtype is MessageType.INFORM:
            return self._inform(pkt, net)
        return Decision(ignored="not-a-client-message", network=net.name)

    # -- DISCOVER -> OFFER ------------------------------------------------------------

    def _pick(
        self, pkt: DhcpPacket, net: NetworkPlan, table: LeaseTable, now: float
    ) -> IPv4Address | None:
        mac = pkt.mac
        reserved = net.reservations.get(mac)
        if reserved is not None:
            return reserved if table.available_to(net.name, reserved, mac, now) else None
        mine = table.for_mac(net.name, mac)
        if (
            mine is not None
            and net.assignable(mine.ip, mac)
            and table.available_to(net.name, mine.ip, mac, now)
        ):
            return mine.ip
        want = pkt.requested_ip
        if (
            want is not None
            and net.assignable(want, mac)
            and table.available_to(net.name, want, mac, now)
        ):
            return want
        return table.find_free(net.name, net.pool_start, net.pool_end, now, net.reserved)

    def _discover(
        self, pkt: DhcpPacket, net: NetworkPlan, table: LeaseTable, now: float
    ) -> Decision:
        kind = classify(pkt)
        ip = self._pick(pkt, net, table, now)
        if ip is None:
            return Decision(ignored="pool-exhausted", network=net.name, kind=kind)
        mac = pkt.mac
        cur = table.get(net.name, ip)
        writes: tuple[LeaseRecord, ...] = ()
        puts: tuple[LeaseRecord, ...] = ()  # the offer (after the binding it ends)
        if not (cur and cur.mac == mac and cur.state == LeaseState.BOUND and cur.holds(now)):
            mine = table.for_mac(net.name, mac)
            if (
                mine is not None
                and mine.ip != ip
                and mine.state == LeaseState.BOUND
                and mine.holds(now)
            ):
                # Its binding may no longer be given (the configuration changed): end it, so
                # that a MAC never holds two addresses (each would be "its" lease).
                ended = mine._replace(state=LeaseState.RELEASED, expires_at=now)
                writes = (ended,)
            offer = LeaseRecord(net.name, ip, mac, LeaseState.OFFERED, now + OFFER_HOLD_SECONDS)
            puts = (*writes, offer) if writes else (offer,)
        reply = self._lease_reply(pkt, MessageType.OFFER, net, ip, kind)
        return Decision(
            reply=reply,
            dest=destination(pkt, reply),
            extra_writes=writes,
            network=net.name,
            kind=kind,
            puts=puts,
        )

    # -- REQUEST -> ACK / NAK -----------------------------------------------------------

    def _request(
        self, pkt: DhcpPacket, net: NetworkPlan, table: LeaseTable, now: float
    ) -> Decision:
        mac = pkt.mac
        sid = pkt.server_id
        if sid is not None and sid != self.server_id:
            # The client took another server's offer: free ours now, not in 30 s.
            rec = table.for_mac(net.name, mac)
            if rec is not None and rec.state == LeaseState.OFFERED:
                freed = (rec._replace(expires_at=now),)
                return Decision(ignored="other-server", network=net.name, puts=freed)
            return Decision(ignored="other-server", network=net.name)
        # RFC 2131 4.3.2. SELECTING (our server id) and INIT-REBOOT (none, ciaddr 0) name the
        # address in option 50; RENEWING and REBINDING in ciaddr.
        ip = pkt.requested_ip if sid is not None or pkt.ciaddr == ZERO else pkt.ciaddr
        if ip is None:
            return Decision(ignored="request-without-address", network=net.name)
        if not net.contains(ip) or not net.assignable(ip, mac):
            return self._nak(pkt, net)  # wrong network, or an address this MAC may not have
        # Only the client's own current record may be (re)bound: the offer it answers or the
        # binding it extends. Binding anything else would let one spoofed chaddr take an
        # address nobody offered it and move another machine's lease (and script) there.
        rec = table.for_mac(net.name, mac)
        if rec is None or rec.ip != ip or rec.state == LeaseState.DECLINED:
            if (
                sid is not None  # it answers an offer of ours that does not exist
                or (rec is not None and rec.state != LeaseState.OFFERED and rec.holds(now))
                or not table.available_to(net.name, ip, mac, now)
            ):
                return self._nak(pkt, net)
            # 4.3.2: no binding of this client here: stay silent. Another server (or
            # instance) may hold it, and a NAK would make a rebinding client drop it.
            return Decision(ignored="request-unknown-client", network=net.name)
        kind = classify(pkt)
        rec = LeaseRecord(
            net.name,
            ip,
            mac,
            LeaseState.BOUND,
            now + net.lease_seconds,
            client_id=(pkt.options.get(Opt.CLIENT_ID) or b"").hex() or None,
            hostname=pkt.hostname,
        )
        reply = self._lease_reply(pkt, MessageType.ACK, net, ip, kind)
        return Decision(
            reply=reply,
            dest=destination(pkt, reply),
            write=rec,
            puts=(rec,),
            # Built only if the write loses a race, off the hot path.
            on_conflict=lambda: self._nak(pkt, net).reply,
            network=net.name,
            kind=kind,
        )

    def _nak(self, pkt: DhcpPacket, net: NetworkPlan) -> Decision:
        reply = reply_skeleton(pkt, MessageType.NAK, self.server_id)
        reply.flags = pkt.flags
        echo_relay_info(pkt, reply)
        return Decision(reply=reply, dest=destination(pkt, reply), network=net.name)

    # -- DECLINE, RELEASE, INFORM ----------------------------------------------------

    def _decline(
        self, pkt: DhcpPacket, net: NetworkPlan, table: LeaseTable, now: float
    ) -> Decision:
        sid = pkt.server_id
        if sid is not None and sid != self.server_id:
            return Decision(ignored="other-server", network=net.name)
        ip = pkt.requested_ip
        rec = table.get(net.name, ip) if ip is not None else None
        if rec is None or rec.mac != pkt.mac or rec.state != LeaseState.BOUND:
            return Decision(ignored="decline-unknown", network=net.name)
        if now - (rec.expires_at - net.lease_seconds) > DECLINE_SECONDS:
            # A client declines what it was just given (its ARP probe found the address in
            # use, 4.4.1); later, a forged DECLINE would take a running machine's address.
            return Decision(ignored="decline-late", network=net.name)
        # Someone else answers for this address: quarantine it for one lease time.
        rec = rec._replace(state=LeaseState.DECLINED, expires_at=now + net.lease_seconds)
        return Decision(write=rec, network=net.name, puts=(rec,))

    def _release(
        self, pkt: DhcpPacket, net: NetworkPlan, table: LeaseTable, now: float
    ) -> Decision:
        rec = table.get(net.name, pkt.ciaddr)
        if rec is None or rec.mac != pkt.mac or rec.state != LeaseState.BOUND:
            return Decision(ignored="release-unknown", network=net.name)
        rec = rec._replace(state=LeaseState.RELEASED, expires_at=now)
        return Decision(write=rec, network=net.name, puts=(rec,))

    def _inform(self, pkt: DhcpPacket, net: NetworkPlan) -> Decision:
        reply = reply_skeleton(pkt, MessageType.ACK, self.server_id)
        reply.ciaddr = pkt.ciaddr
        reply.options.update(net.base_options)
        kind = classify(pkt)
        add_boot(reply, kind, pkt.mac, self.files, self.server_id)
        echo_relay_info(pkt, reply)
        return Decision(reply=reply, dest=destination(pkt, reply), network=net.name, kind=kind)

    def _lease_reply(
        self,
        pkt: DhcpPacket,
        mtype: MessageType,
        net: NetworkPlan,
        ip: IPv4Address,
        kind: object,
    ) -> DhcpPacket:
        reply = reply_skeleton(pkt, mtype, self.server_id)
        reply.yiaddr = ip
        reply.ciaddr = pkt.ciaddr if mtype is MessageType.ACK else ZERO
        reply.options.update(net.lease_options)  # 51, 58, 59, precomputed per network
        reply.options.update(net.base_options)
        if add_boot(reply, kind, pkt.mac, self.files, self.server_id) and kind.ipxe:  # type: ignore[arg-type,attr-defined]
            reply.options[IPXE_ENCAP] = IPXE_NO_PXEDHCP
        echo_relay_info(pkt, reply)
        return reply
