"""Full-mode DHCP: metald owns the addresses. Decisions from a packet and the lease table; no I/O.

``decide`` only reads the table: the records it creates (offers, bindings, ended leases) are
returned in the decision's ``puts`` and the shell applies them. Offers live only in memory
(short hold, so two DISCOVERs never get the same address); an ACK is a durable write that must
commit before the ACK is sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from ipaddress import IPv4Address

from metald.boot.dhcp.bootfile import PLAIN, BootFiles, ClientKind, classify
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
from metald.boot.dhcp.packet import ZERO, DhcpPacket, MalformedPacket, MessageType, Op, Opt

#: How long an offered address is held for the client's REQUEST.
OFFER_HOLD_SECONDS = 30
#: How long after its ACK a binding may be declined (the client's ARP probe takes seconds).
DECLINE_SECONDS = 60

# Module constants for the hot path: an enum member's attribute access costs ~3x a global's.
_DISCOVER, _REQUEST = MessageType.DISCOVER, MessageType.REQUEST
_DECLINE, _RELEASE, _INFORM = MessageType.DECLINE, MessageType.RELEASE, MessageType.INFORM
_OFFER, _ACK = MessageType.OFFER, MessageType.ACK
_BOUND, _OFFERED, _DECLINED = LeaseState.BOUND, LeaseState.OFFERED, LeaseState.DECLINED
_MTYPE, _SERVER_ID, _REQUESTED_IP = Opt.MESSAGE_TYPE, Opt.SERVER_ID, Opt.REQUESTED_IP
_CLIENT_ID, _HOSTNAME, _REPLY = Opt.CLIENT_ID, Opt.HOSTNAME, int(Op.REPLY)


@dataclass
class FullHandler:
    server_id: IPv4Address
    files: BootFiles
    #: (network plan, message type) -> the reply options every lease reply of that type on
    #: that network starts with (53, 54, 51, 58, 59, 1, 3, 6, in that order), copied per reply.
    _templates: dict[tuple[int, MessageType], tuple[NetworkPlan, dict[int, bytes]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: The server id as option 54 carries it: a REQUEST's server id is compared as bytes.
    _sid_raw: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._sid_raw = self.server_id.packed

    def handle(self, pkt: DhcpPacket, net: NetworkPlan, table: LeaseTable, now: float) -> Decision:
        """``decide``, then apply its records to ``table`` (what the shell does)."""
        d = self.decide(pkt, net, table, now)
        if d.puts:
            table.apply(d.puts)
        return d

    def decide(self, pkt: DhcpPacket, net: NetworkPlan, table: LeaseTable, now: float) -> Decision:
        """The decision for one packet. Reads ``table``, never changes it."""
        mtype = pkt.message_type
        if mtype is _DISCOVER:
            return self._discover(pkt, net, table, now)
        if mtype is _REQUEST:
            return self._request(pkt, net, table, now)
        if mtype is _DECLINE:
            return self._decline(pkt, net, table, now)
        if mtype is _RELEASE:
            return self._release(pkt, net, table, now)
        if mtype is _INFORM:
            return self._inform(pkt, net)
        return Decision(ignored="not-a-client-message", network=net.name)

    # -- DISCOVER -> OFFER ------------------------------------------------------------

    def _pick(
        self, pkt: DhcpPacket, mac: str, net: NetworkPlan, table: LeaseTable, now: float
    ) -> IPv4Address | None:
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
        mac = pkt.mac
        ip = self._pick(pkt, mac, net, table, now)
        if ip is None:
            return Decision(ignored="pool-exhausted", network=net.name, kind=kind)
        cur = table.get(net.name, ip)
        writes: tuple[LeaseRecord, ...] = ()
        puts: tuple[LeaseRecord, ...] = ()  # the offer (after the binding it ends)
        if not (cur and cur.mac == mac and cur.state == _BOUND and cur.holds(now)):
            mine = table.for_mac(net.name, mac)
            if mine is not None and mine.ip != ip and mine.state == _BOUND and mine.holds(now):
                # Its binding may no longer be given (the configuration changed): end it, so
                # that a MAC never holds two addresses (each would be "its" lease).
                ended = mine._replace(state=LeaseState.RELEASED, expires_at=now)
                writes = (ended,)
            offer = LeaseRecord(net.name, ip, mac, _OFFERED, now + OFFER_HOLD_SECONDS)
            puts = (*writes, offer) if writes else (offer,)
        reply = self._lease_reply(pkt, _OFFER, net, ip, kind)
        return Decision(
            reply, destination(pkt, reply), None, writes, None, None, net.name, kind, puts
        )

    # -- REQUEST -> ACK / NAK -----------------------------------------------------------

    def _request(
        self, pkt: DhcpPacket, net: NetworkPlan, table: LeaseTable, now: float
    ) -> Decision:
        mac = pkt.mac
        opts = pkt.options
        sid_raw = opts.get(_SERVER_ID)
        if sid_raw is not None and sid_raw != self._sid_raw:
            if len(sid_raw) != 4:
                raise MalformedPacket(
                    "bad-option-length", f"option 54 has {len(sid_raw)} bytes, not 4"
                )
            # The client took another server's offer: free ours now, not in 30 s.
            rec = table.for_mac(net.name, mac)
            if rec is not None and rec.state == _OFFERED:
                freed = (rec._replace(expires_at=now),)
                return Decision(ignored="other-server", network=net.name, puts=freed)
            return Decision(ignored="other-server", network=net.name)
        # The client's own current record (the offer it answers or the binding it extends).
        rec = table.for_mac(net.name, mac)
        # RFC 2131 4.3.2. SELECTING (our server id) and INIT-REBOOT (none, ciaddr 0) name the
        # address in option 50; RENEWING and REBINDING in ciaddr.
        ci = pkt.ciaddr
        if sid_raw is not None or ci is ZERO or ci == ZERO:
            want = opts.get(_REQUESTED_IP)
            if want is not None and rec is not None and rec.ip.packed == want:
                ip: IPv4Address | None = rec.ip  # the usual case: no new address object
            else:
                ip = pkt.requested_ip
        else:
            ip = ci
        if ip is None:
            return Decision(ignored="request-without-address", network=net.name)
        if not net.contains(ip) or not net.assignable(ip, mac):
            return self._nak(pkt, net)  # wrong network, or an address this MAC may not have
        # Only the client's own current record may be (re)bound: the offer it answers or the
        # binding it extends. Binding anything else would let one spoofed chaddr take an
        # address nobody offered it and move another machine's lease (and script) there.
        if rec is None or (rec.ip is not ip and rec.ip != ip) or rec.state == _DECLINED:
            if (
                sid_raw is not None  # it answers an offer of ours that does not exist
                or (rec is not None and rec.state != _OFFERED and rec.holds(now))
                or not table.available_to(net.name, ip, mac, now)
            ):
                return self._nak(pkt, net)
            # 4.3.2: no binding of this client here: stay silent. Another server (or
            # instance) may hold it, and a NAK would make a rebinding client drop it.
            return Decision(ignored="request-unknown-client", network=net.name)
        kind = classify(pkt)
        cid = opts.get(_CLIENT_ID)
        host = opts.get(_HOSTNAME)
        rec = LeaseRecord(
            net.name,
            ip,
            mac,
            _BOUND,
            now + net.lease_seconds,
            cid.hex() if cid else None,
            host.decode("ascii", "replace") if host else None,
        )
        reply = self._lease_reply(pkt, _ACK, net, ip, kind)
        return Decision(
            reply,
            destination(pkt, reply),
            rec,
            (),
            # Built only if the write loses a race, off the hot path.
            lambda: self._nak(pkt, net).reply,
            None,
            net.name,
            kind,
            (rec,),
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
        kind: ClientKind,
    ) -> DhcpPacket:
        # reply_skeleton + lease and network options, from the per-network template: one dict
        # copy instead of building and updating a dict per reply (same options, same order).
        t = self._templates.get((id(net), mtype))
        if t is None or t[0] is not net:
            t = self._template(net, mtype)
        # Positional, in DhcpPacket's field order: op htype hlen hops xid secs flags ciaddr
        # yiaddr siaddr giaddr chaddr sname file options.
        reply = DhcpPacket(
            _REPLY,
            pkt.htype,
            pkt.hlen,
            0,
            pkt.xid,
            0,
            pkt.flags,
            pkt.ciaddr if mtype is _ACK else ZERO,
            ip,
            ZERO,
            pkt.giaddr,
            pkt.chaddr,
            b"",
            b"",
            t[1].copy(),
        )
        if (
            kind is not PLAIN
            and add_boot(reply, kind, pkt.mac, self.files, self.server_id)
            and kind.ipxe
        ):
            reply.options[IPXE_ENCAP] = IPXE_NO_PXEDHCP
        v = pkt.options.get(Opt.RELAY_AGENT)
        if v is not None:  # echo_relay_info: option 82 copied back, last (RFC 3046)
            reply.options[Opt.RELAY_AGENT] = v
        return reply

    def _template(
        self, net: NetworkPlan, mtype: MessageType
    ) -> tuple[NetworkPlan, dict[int, bytes]]:
        opts = reply_skeleton(DhcpPacket(), mtype, self.server_id).options
        opts.update(net.lease_options)  # 51, 58, 59, precomputed per network
        opts.update(net.base_options)
        if len(self._templates) >= 256:  # plans rebuilt on every reload: keep it bounded
            self._templates.clear()
        t = self._templates[(id(net), mtype)] = (net, opts)
        return t
