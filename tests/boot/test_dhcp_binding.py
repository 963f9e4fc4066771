"""RFC 2131 4.3.2 binding rules: a REQUEST binds only the address metald offered that MAC or
the binding it already has. Spoofed RENEWING / REBINDING / INIT-REBOOT / SELECTING requests
get no ACK, write nothing and never move or release another machine's lease; real clients'
renewals and reboots keep their address."""

from __future__ import annotations

from ipaddress import IPv4Address

from hypothesis import given, settings
from hypothesis import strategies as st

from metald.boot.dhcp.common import NetworkPlan
from metald.boot.dhcp.full import DECLINE_SECONDS, FullHandler
from metald.boot.dhcp.lease_store import LeaseRecord, LeaseState, LeaseStore, LeaseTable
from metald.boot.dhcp.packet import BROADCAST_FLAG, MessageType, Opt, serialize
from metald.boot.machine_hooks import holds_lease

from .dhcp_helpers import IPXE_BIOS, client_packet
from .test_dhcp_server import LO, recv, start
from .test_dhcp_server import dora as server_dora
from .test_full import FILES, SERVER, dora, net

VICTIM = "52:54:00:00:00:0a"
ATTACKER = "52:54:00:00:00:0b"
NEVER_LEASED = IPv4Address("10.0.0.103")
RELAY = IPv4Address("10.0.0.254")


def setup() -> tuple[FullHandler, NetworkPlan, LeaseTable, IPv4Address]:
    """The victim holds a binding (DORA at t=1000); returns its address."""
    h, n, t = FullHandler(SERVER, FILES), net(), LeaseTable()
    _, ack = dora(h, n, t, VICTIM, options=IPXE_BIOS)
    assert ack.reply.message_type is MessageType.ACK
    return h, n, t, ack.reply.yiaddr


def snapshot(t: LeaseTable) -> list[tuple[str, IPv4Address, str, LeaseState, float]]:
    return sorted((r.network, r.ip, r.mac, r.state, r.expires_at) for r in t.records())


def assert_refused(d, before, t: LeaseTable) -> None:  # type: ignore[no-untyped-def]
    """No ACK, nothing written, the table as it was."""
    assert d.reply is None or d.reply.message_type is MessageType.NAK, d
    assert d.write is None and not d.extra_writes
    assert snapshot(t) == before


def renewing(mac: str, ip: IPv4Address, **kw) -> object:  # type: ignore[no-untyped-def]
    return client_packet(MessageType.REQUEST, mac, ciaddr=ip, **kw)


def init_reboot(mac: str, ip: IPv4Address) -> object:
    return client_packet(MessageType.REQUEST, mac, options={Opt.REQUESTED_IP: ip.packed})


def selecting(mac: str, ip: IPv4Address) -> object:
    opts = {Opt.REQUESTED_IP: ip.packed, Opt.SERVER_ID: SERVER.packed}
    return client_packet(MessageType.REQUEST, mac, options=opts)


# -- spoofed requests -------------------------------------------------------------------


def test_renewing_for_an_address_never_leased_binds_nothing_and_keeps_the_victims_lease() -> None:
    """The issue's attack: chaddr = the victim, ciaddr = an address of the attacker's choice."""
    h, n, t, victim_ip = setup()
    before = snapshot(t)
    d = h.handle(renewing(VICTIM, NEVER_LEASED), n, t, 1010)
    assert_refused(d, before, t)
    assert d.reply is not None  # we know this client: its address is not that one (NAK)
    rec = t.for_mac("prov", VICTIM)
    assert rec is not None and rec.ip == victim_ip and rec.state is LeaseState.BOUND
    assert rec.expires_at == 1000 + n.lease_seconds


def test_renewing_from_a_client_metald_never_saw_is_ignored() -> None:
    h, n, t, _ = setup()
    before = snapshot(t)
    d = h.handle(renewing("52:54:00:00:00:99", NEVER_LEASED), n, t, 1010)
    assert_refused(d, before, t)
    # 4.3.2: no record of this client: silent (another server may have leased it).
    assert d.reply is None and d.ignored == "request-unknown-client"


def test_renewing_for_an_address_leased_to_another_mac() -> None:
    h, n, t, victim_ip = setup()
    before = snapshot(t)
    for mac in (ATTACKER, "52:54:00:00:00:99"):  # one with a lease of its own, one without
        if mac == ATTACKER:
            dora(h, n, t, ATTACKER)
            before = snapshot(t)
        assert_refused(h.handle(renewing(mac, victim_ip), n, t, 1010), before, t)
    # Also once the victim's lease has expired but nobody else took the address.
    late = 1000 + n.lease_seconds + 5
    assert_refused(h.handle(renewing(ATTACKER, victim_ip), n, t, late), before, t)


def test_rebinding_broadcast_and_relayed_for_an_address_never_leased() -> None:
    h, n, t, victim_ip = setup()
    before = snapshot(t)
    relayed = renewing(VICTIM, NEVER_LEASED, giaddr=RELAY, flags=BROADCAST_FLAG)
    assert_refused(h.handle(relayed, n, t, 1500), before, t)
    broadcast = renewing(VICTIM, NEVER_LEASED, flags=BROADCAST_FLAG)
    assert_refused(h.handle(broadcast, n, t, 1500), before, t)
    assert t.for_mac("prov", VICTIM).ip == victim_ip  # type: ignore[union-attr]


def test_init_reboot_without_a_binding() -> None:
    h, n, t, victim_ip = setup()
    before = snapshot(t)
    # Unknown client: silent.
    d = h.handle(init_reboot("52:54:00:00:00:99", NEVER_LEASED), n, t, 1010)
    assert_refused(d, before, t)
    assert d.reply is None
    # Known client, another address: NAK, its own binding untouched.
    d = h.handle(init_reboot(VICTIM, NEVER_LEASED), n, t, 1010)
    assert_refused(d, before, t)
    assert d.reply is not None and d.reply.message_type is MessageType.NAK
    # Someone else's address.
    assert_refused(h.handle(init_reboot(ATTACKER, victim_ip), n, t, 1010), before, t)


def test_selecting_an_address_that_was_never_offered_is_naked() -> None:
    h, n, t, victim_ip = setup()
    before = snapshot(t)
    for mac, ip in ((VICTIM, NEVER_LEASED), (ATTACKER, NEVER_LEASED), (ATTACKER, victim_ip)):
        d = h.handle(selecting(mac, ip), n, t, 1010)
        assert_refused(d, before, t)
        assert d.reply is not None and d.reply.message_type is MessageType.NAK


def test_offer_to_another_mac_cannot_be_taken() -> None:
    h, n, t, _ = setup()
    off = h.handle(client_packet(MessageType.DISCOVER, ATTACKER), n, t, 1010)
    offered = off.reply.yiaddr
    before = snapshot(t)
    for pkt in (
        selecting(VICTIM, offered),
        init_reboot(VICTIM, offered),
        renewing(VICTIM, offered),
    ):
        assert_refused(h.handle(pkt, n, t, 1011), before, t)


def test_late_or_foreign_decline_cannot_take_a_running_machines_address() -> None:
    """DECLINE (quarantine) then DORA as the victim would move its lease: only a decline
    right after the ACK, naming this server (or none), is taken."""
    h, n, t, victim_ip = setup()
    before = snapshot(t)
    late = client_packet(MessageType.DECLINE, VICTIM, options={Opt.REQUESTED_IP: victim_ip.packed})
    d = h.handle(late, n, t, 1000 + DECLINE_SECONDS + 1)
    assert d.ignored == "decline-late" and d.write is None and snapshot(t) == before
    other = client_packet(
        MessageType.DECLINE,
        VICTIM,
        options={Opt.REQUESTED_IP: victim_ip.packed, Opt.SERVER_ID: b"\x0a\x00\x00\x09"},
    )
    assert h.handle(other, n, t, 1001).write is None and snapshot(t) == before
    # The client's own decline, seconds after its ACK, is still honoured.
    assert h.handle(late, n, t, 1002).write.state is LeaseState.DECLINED  # type: ignore[union-attr]


def test_a_client_of_another_server_rebinding_is_left_alone() -> None:
    """Two servers (or instances) on one segment: the client took the other's offer. When it
    rebinds (broadcast), this server has only its own withdrawn offer for that MAC: it stays
    silent rather than NAK a lease it knows nothing about (a NAK makes the client drop it)."""
    h, n, t = FullHandler(SERVER, FILES), net(), LeaseTable()
    mac = "52:54:00:00:00:77"
    ours = h.handle(client_packet(MessageType.DISCOVER, mac), n, t, 1000).reply.yiaddr
    theirs = IPv4Address(int(ours) + 1)
    took_other = client_packet(
        MessageType.REQUEST,
        mac,
        options={Opt.REQUESTED_IP: theirs.packed, Opt.SERVER_ID: b"\x0a\x00\x00\x09"},
    )
    assert h.handle(took_other, n, t, 1001).ignored == "other-server"
    before = snapshot(t)
    d = h.handle(renewing(mac, theirs, flags=BROADCAST_FLAG), n, t, 1500)
    assert_refused(d, before, t)
    assert d.reply is None and d.ignored == "request-unknown-client"


# -- legitimate clients -----------------------------------------------------------------


def test_renewal_and_rebinding_of_own_binding_keep_the_address() -> None:
    h, n, t, ip = setup()
    d = h.handle(renewing(VICTIM, ip), n, t, 1300)
    assert d.reply.message_type is MessageType.ACK and d.reply.yiaddr == ip
    assert d.write.ip == ip and d.write.expires_at == 1300 + n.lease_seconds
    assert d.dest == (str(ip), 68)
    d = h.handle(renewing(VICTIM, ip, giaddr=RELAY, flags=BROADCAST_FLAG), n, t, 1500)
    assert d.reply.message_type is MessageType.ACK and d.write.ip == ip
    # Even a little after expiry, while nobody else took it (as Kea and dhcpd allow).
    d = h.handle(renewing(VICTIM, ip), n, t, 1500 + n.lease_seconds + 1)
    assert d.reply.message_type is MessageType.ACK and d.write.ip == ip


def test_init_reboot_of_own_binding_is_acked() -> None:
    h, n, t, ip = setup()
    d = h.handle(init_reboot(VICTIM, ip), n, t, 1100)
    assert d.reply.message_type is MessageType.ACK and d.reply.yiaddr == ip
    assert d.write.state is LeaseState.BOUND and d.write.mac == VICTIM


def test_request_after_offer_is_acked_in_both_forms() -> None:
    h, n, t = FullHandler(SERVER, FILES), net(), LeaseTable()
    for mac, form in (("52:54:00:00:00:01", selecting), ("52:54:00:00:00:02", init_reboot)):
        off = h.handle(client_packet(MessageType.DISCOVER, mac), n, t, 1000)
        d = h.handle(form(mac, off.reply.yiaddr), n, t, 1001)  # type: ignore[operator]
        assert d.reply.message_type is MessageType.ACK and d.write.ip == off.reply.yiaddr


def test_a_moved_binding_is_ended_not_left_behind() -> None:
    """If a MAC's binding may no longer be given (config changed), its new offer ends it: a
    MAC never holds two addresses, each of which would pass the script's lease check."""
    h, n, t, old_ip = setup()
    moved = net(reservations={VICTIM: IPv4Address("10.0.0.50")})
    off = h.handle(client_packet(MessageType.DISCOVER, VICTIM), moved, t, 1100)
    assert off.reply.yiaddr == IPv4Address("10.0.0.50")
    assert [(w.ip, w.state) for w in off.extra_writes] == [(old_ip, LeaseState.RELEASED)]
    ack = h.handle(selecting(VICTIM, off.reply.yiaddr), moved, t, 1101)
    assert ack.reply.message_type is MessageType.ACK
    bound = [r for r in t.records() if r.mac == VICTIM and r.state is LeaseState.BOUND]
    assert [r.ip for r in bound] == [IPv4Address("10.0.0.50")]


async def test_after_a_restart_a_mac_is_current_at_its_last_binding(store) -> None:  # type: ignore[no-untyped-def]
    """load() puts rows in write order: a MAC's older released row never becomes its
    'current' record (which would let an INIT-REBOOT for the old address pass)."""
    ls = LeaseStore(store)
    old = LeaseRecord("prov", IPv4Address("10.0.0.100"), VICTIM, LeaseState.RELEASED, 1.0)
    new = LeaseRecord("prov", IPv4Address("10.0.0.101"), VICTIM, LeaseState.BOUND, 4e9)
    results: list[object] = []
    # The bound row is inserted first and the released one later, then the bound one is
    # written again: insertion order alone would make the released row current.
    for rec in (new, old, new):
        ls.submit(rec, results.append)
        await ls.drain()
    ls.close()
    fresh = LeaseStore(store)
    await fresh.load()
    fresh.close()
    cur = fresh.table.for_mac("prov", VICTIM)
    assert cur is not None and cur.ip == new.ip and cur.state is LeaseState.BOUND
    h, n = FullHandler(SERVER, FILES), net()
    before = snapshot(fresh.table)
    assert_refused(h.handle(init_reboot(VICTIM, old.ip), n, fresh.table, 2000), before, fresh.table)
    d = h.handle(init_reboot(VICTIM, new.ip), n, fresh.table, 2000)
    assert d.reply.message_type is MessageType.ACK


# -- the invariant, under arbitrary interleavings ---------------------------------------

VICTIMS = [f"52:54:00:00:01:{i:02x}" for i in range(3)]
spoofs = st.lists(
    st.tuples(
        st.sampled_from(["renew", "rebind", "init-reboot", "select", "decline", "discover"]),
        st.sampled_from(VICTIMS + [ATTACKER]),  # chaddr the attacker puts in
        st.integers(0, 5),  # which address it names (pool is .100-.103; .104/.105 outside)
        st.integers(0, 200),  # time step
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(spoofs)
def test_spoofed_requests_never_move_or_release_a_binding(seq) -> None:  # type: ignore[no-untyped-def]
    """Victims hold bindings; nothing the attacker sends (any form, any chaddr, any address)
    changes a victim's bound address, and every ACK names a pair that was already the MAC's."""
    h, n, t = FullHandler(SERVER, FILES), net(), LeaseTable()
    now = 1000.0
    bound: dict[str, IPv4Address] = {}
    for mac in VICTIMS:
        _, ack = dora(h, n, t, mac, now=now)
        bound[mac] = ack.reply.yiaddr
    for op, mac, a, dt in seq:
        now += dt
        ip = IPv4Address(int(n.pool_start) + a)
        opts: dict[int, bytes] = {}
        kw: dict[str, object] = {}
        if op in ("renew", "rebind"):
            kw["ciaddr"] = ip
            if op == "rebind":
                kw.update(giaddr=RELAY, flags=BROADCAST_FLAG)
        elif op in ("init-reboot", "select", "decline"):
            opts[Opt.REQUESTED_IP] = ip.packed
            if op == "select":
                opts[Opt.SERVER_ID] = SERVER.packed
        mtype = {"decline": MessageType.DECLINE, "discover": MessageType.DISCOVER}.get(
            op, MessageType.REQUEST
        )
        prior = t.for_mac("prov", mac)
        prior_pair = None if prior is None else (prior.ip, prior.state)
        was_live = {v: live(t, v, vip, now) for v, vip in bound.items()}
        d = h.handle(client_packet(mtype, mac, options=opts, **kw), n, t, now)  # type: ignore[arg-type]
        if d.reply is not None and d.reply.message_type is MessageType.ACK:
            # Only the MAC's own current record (its offer or binding) is ever bound.
            assert prior_pair is not None and prior_pair[0] == d.write.ip
            assert prior_pair[1] is not LeaseState.DECLINED
        for w in [*d.extra_writes, *([d.write] if d.write else [])]:
            assert w.mac == mac  # nothing a packet writes belongs to another MAC
        for v, vip in bound.items():
            if was_live[v] and not (op == "decline" and mac == v):
                # Only time, or the victim's own timely DECLINE, ends a live binding.
                rec = t.get("prov", vip)
                assert rec is not None and rec.mac == v and rec.state is LeaseState.BOUND
            if live(t, v, vip, now):
                # ... and while it lives the victim holds no second address.
                assert t.for_mac("prov", v) is t.get("prov", vip)
                others = [
                    r
                    for r in t.records()
                    if r.mac == v and r.state is LeaseState.BOUND and r.ip != vip and r.holds(now)
                ]
                assert not others


def live(t: LeaseTable, mac: str, ip: IPv4Address, now: float) -> bool:
    rec = t.get("prov", ip)
    return rec is not None and rec.mac == mac and rec.state is LeaseState.BOUND and rec.holds(now)


async def test_spoofed_renewal_through_the_server_leaves_the_script_gate_shut(store) -> None:  # type: ignore[no-untyped-def]
    """End to end on loopback with the lease store: after the spoofed RENEWING the lease rows
    still give the victim's MAC only its own address, which is what the script gate reads."""
    srv, relay, leases = await start(store)
    try:
        victim_ip = (await server_dora(srv, relay, VICTIM)).yiaddr
        attacker_ip = IPv4Address("127.0.5.5")
        to = srv._listeners[0].sock.getsockname()
        relay.sendto(serialize(renewing(VICTIM, attacker_ip, giaddr=LO)), to)  # type: ignore[arg-type]
        # Then the victim's own renewal. Both are handled in order on one socket, and the
        # ACK leaves only after its commit: once it is here, the spoof was handled too.
        relay.sendto(serialize(renewing(VICTIM, victim_ip, giaddr=LO)), to)  # type: ignore[arg-type]
        replies = [await recv(relay), await recv(relay)]
        assert [r.message_type for r in replies] == [MessageType.NAK, MessageType.ACK]
        assert replies[1].yiaddr == victim_ip
        with store.session() as s:
            assert holds_lease(s, VICTIM, str(victim_ip))
            assert not holds_lease(s, VICTIM, str(attacker_ip))
    finally:
        await srv.stop()
        leases.close()
        relay.close()
