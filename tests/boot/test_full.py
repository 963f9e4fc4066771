"""Full-mode decisions: DORA, reservations, renew, decline, release, relays, boot files."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metald.boot.dhcp.bootfile import BootFiles
from metald.boot.dhcp.common import NetworkPlan, choose_network
from metald.boot.dhcp.full import FullHandler
from metald.boot.dhcp.leasetable import LeaseState, LeaseTable
from metald.boot.dhcp.packet import BROADCAST_FLAG, MessageType, Opt, encode_tlv, parse, serialize

from .dhcp_helpers import HTTP_UEFI, IPXE_BIOS, PXE_BIOS, PXE_UEFI, client_packet

SERVER = IPv4Address("10.0.0.1")
FILES = BootFiles(http_base="http://10.0.0.1:8080")


def net(**kw) -> NetworkPlan:  # type: ignore[no-untyped-def]
    args = dict(
        name="prov",
        subnet=IPv4Network("10.0.0.0/24"),
        pool_start=IPv4Address("10.0.0.100"),
        pool_end=IPv4Address("10.0.0.103"),
        lease_seconds=600,
        interface="eth1",
        router=IPv4Address("10.0.0.1"),
        dns=[IPv4Address("10.0.0.2")],
    )
    args.update(kw)
    return NetworkPlan(**args)  # type: ignore[arg-type]


def dora(h: FullHandler, n: NetworkPlan, t: LeaseTable, mac: str, now: float = 1000.0, **kw):  # type: ignore[no-untyped-def]
    offer = h.handle(client_packet(MessageType.DISCOVER, mac, **kw), n, t, now)
    assert offer.reply is not None, offer.ignored
    ip = offer.reply.yiaddr
    req = client_packet(
        MessageType.REQUEST,
        mac,
        **{
            **kw,
            "options": {
                **kw.get("options", {}),
                Opt.REQUESTED_IP: ip.packed,
                Opt.SERVER_ID: SERVER.packed,
            },
        },
    )
    return offer, h.handle(req, n, t, now)


def test_dora_gives_an_address_with_network_options() -> None:
    h, n, t = FullHandler(SERVER, FILES), net(), LeaseTable()
    offer, ack = dora(h, n, t, "52:54:00:00:00:01")
    assert offer.reply.message_type is MessageType.OFFER
    assert ack.reply.message_type is MessageType.ACK
    assert ack.write is not None and ack.write.state is LeaseState.BOUND
    r = parse(serialize(ack.reply))
    assert r.yiaddr in n.subnet and n.in_pool(r.yiaddr)
    assert r.options[Opt.SUBNET_MASK] == b"\xff\xff\xff\x00"
    assert r.options[Opt.ROUTER] == SERVER.packed
    assert int.from_bytes(r.options[Opt.LEASE_TIME], "big") == 600
    assert r.server_id == SERVER
    assert Opt.BOOTFILE not in r.options  # a plain client is not network-booting
    assert ack.dest == ("255.255.255.255", 68)


def test_same_client_keeps_its_address_and_others_get_different_ones() -> None:
    h, n, t = FullHandler(SERVER, FILES), net(), LeaseTable()
    _, a1 = dora(h, n, t, "52:54:00:00:00:01")
    _, a2 = dora(h, n, t, "52:54:00:00:00:02")
    _, a1b = dora(h, n, t, "52:54:00:00:00:01", now=1100)
    assert a1.reply.yiaddr == a1b.reply.yiaddr != a2.reply.yiaddr


def test_pool_exhaustion_and_expiry() -> None:
    h, n, t = FullHandler(SERVER, FILES), net(), LeaseTable()
    for i in range(4):
        dora(h, n, t, f"52:54:00:00:00:{i:02x}")
    full = h.handle(client_packet(MessageType.DISCOVER, "52:54:00:00:01:00"), n, t, 1000)
    assert full.reply is None and full.ignored == "pool-exhausted"
    # After the leases expire (600 s) the addresses are free again.
    later = h.handle(client_packet(MessageType.DISCOVER, "52:54:00:00:01:00"), n, t, 1700)
    assert later.reply is not None


def test_reservation_is_given_only_to_its_owner() -> None:
    n = net(reservations={"52-54-00-00-00-AA": IPv4Address("10.0.0.50")})
    h, t = FullHandler(SERVER, FILES), LeaseTable()
    _, ack = dora(h, n, t, "52:54:00:00:00:aa")
    assert ack.reply.yiaddr == IPv4Address("10.0.0.50")
    req = client_packet(
        MessageType.REQUEST,
        "52:54:00:00:00:bb",
        options={Opt.REQUESTED_IP: IPv4Address("10.0.0.50").packed},
    )
    assert h.handle(req, n, t, 1000).reply.message_type is MessageType.NAK


def test_init_reboot_wrong_subnet_is_naked_and_renew_is_unicast() -> None:
    h, n, t = FullHandler(SERVER, FILES), net(), LeaseTable()
    _, ack = dora(h, n, t, "52:54:00:00:00:01")
    ip = ack.reply.yiaddr
    wrong = client_packet(MessageType.REQUEST, options={Opt.REQUESTED_IP: b"\xc0\xa8\x00\x05"})
    nak = h.handle(wrong, n, t, 1000)
    assert nak.reply.message_type is MessageType.NAK and nak.dest == ("255.255.255.255", 68)
    renew = h.handle(client_packet(MessageType.REQUEST, ciaddr=ip), n, t, 1200)
    assert renew.reply.message_type is MessageType.ACK and renew.dest == (str(ip), 68)
    assert renew.write.expires_at == 1800


def test_request_for_another_server_frees_our_offer() -> None:
    h, n, t = FullHandler(SERVER, FILES), net(), LeaseTable()
    off = h.handle(client_packet(MessageType.DISCOVER), n, t, 1000)
    other = client_packet(
        MessageType.REQUEST,
        options={Opt.SERVER_ID: b"\x0a\x00\x00\x09", Opt.REQUESTED_IP: off.reply.yiaddr.packed},
    )
    assert h.handle(other, n, t, 1000).ignored == "other-server"
    assert t.available_to("prov", off.reply.yiaddr, "52:54:00:99:99:99", 1000.5)


def test_decline_quarantines_and_release_frees() -> None:
    h, n, t = FullHandler(SERVER, FILES), net(), LeaseTable()
    _, ack = dora(h, n, t, "52:54:00:00:00:01")
    ip = ack.reply.yiaddr
    d = h.handle(
        client_packet(MessageType.DECLINE, options={Opt.REQUESTED_IP: ip.packed}), n, t, 1001
    )
    assert d.reply is None and d.write.state is LeaseState.DECLINED
    again = h.handle(client_packet(MessageType.DISCOVER), n, t, 1002)
    assert again.reply.yiaddr != ip  # not even to the client that declined it
    _, ack2 = dora(h, n, t, "52:54:00:00:00:02", now=1003)
    rel = h.handle(
        client_packet(MessageType.RELEASE, "52:54:00:00:00:02", ciaddr=ack2.reply.yiaddr),
        n,
        t,
        1004,
    )
    assert rel.write.state is LeaseState.RELEASED
    assert t.available_to("prov", ack2.reply.yiaddr, "52:54:00:00:00:77", 1004)


def test_relay_selects_network_by_giaddr_and_link_selection_and_echoes_82() -> None:
    a = net()
    b = net(
        name="rack2",
        subnet=IPv4Network("10.2.0.0/24"),
        pool_start=IPv4Address("10.2.0.10"),
        pool_end=IPv4Address("10.2.0.20"),
        interface="",
    )
    opt82 = encode_tlv({1: b"Eth1/7", 2: b"leaf-3"})
    pkt = client_packet(
        MessageType.DISCOVER, giaddr=IPv4Address("10.2.0.1"), options={Opt.RELAY_AGENT: opt82}
    )
    assert choose_network(pkt, "eth1", [a, b]) is b
    ls = encode_tlv({5: IPv4Address("10.0.0.1").packed})
    pkt2 = client_packet(
        MessageType.DISCOVER, giaddr=IPv4Address("10.2.0.1"), options={Opt.RELAY_AGENT: ls}
    )
    assert choose_network(pkt2, "eth1", [a, b]) is a
    unknown = client_packet(MessageType.DISCOVER, giaddr=IPv4Address("192.168.9.1"))
    assert choose_network(unknown, "eth1", [a, b]) is None
    # A direct packet on an interface no network is configured on is never answered.
    assert choose_network(client_packet(MessageType.DISCOVER), "eth9", [a, b]) is None
    d = FullHandler(SERVER, FILES).handle(pkt, b, LeaseTable(), 1000)
    assert d.dest == ("10.2.0.1", 67)
    assert list(d.reply.options)[-1] == Opt.RELAY_AGENT
    assert d.reply.options[Opt.RELAY_AGENT] == opt82


def test_broadcast_flag_and_relay_nak_flags() -> None:
    h, n, t = FullHandler(SERVER, FILES), net(), LeaseTable()
    d = h.handle(client_packet(MessageType.DISCOVER, flags=BROADCAST_FLAG), n, t, 1000)
    assert d.dest == ("255.255.255.255", 68) and d.reply.broadcast
    relay_n = net(interface="")
    req = client_packet(
        MessageType.REQUEST,
        giaddr=IPv4Address("10.0.0.254"),
        options={Opt.REQUESTED_IP: b"\x0a\x00\x00\xfa"},
    )
    nak = h.handle(req, relay_n, t, 1000)
    assert nak.reply.message_type is MessageType.NAK and nak.reply.broadcast
    assert nak.dest == ("10.0.0.254", 67)


def test_boot_file_by_client_kind() -> None:
    h, n = FullHandler(SERVER, FILES), net()
    cases = {
        "bios": (PXE_BIOS, b"undionly.kpxe"),
        "uefi": (PXE_UEFI, b"snponly.efi"),
        "http": (HTTP_UEFI, b"http://10.0.0.1:8080/boot/assets/snponly.efi"),
        "ipxe": (IPXE_BIOS, b"http://10.0.0.1:8080/boot/52:54:00:00:00:01.ipxe"),
    }
    for name, (opts, want) in cases.items():
        d = h.handle(client_packet(MessageType.DISCOVER, options=opts), n, LeaseTable(), 1000)
        r = d.reply
        assert r.options[Opt.BOOTFILE] == want, name
        assert r.file == want and r.siaddr == SERVER, name
    http = h.handle(client_packet(MessageType.DISCOVER, options=HTTP_UEFI), n, LeaseTable(), 1000)
    assert http.reply.options[Opt.VENDOR_CLASS] == b"HTTPClient"
    # No PXEClient class in a full-mode offer: EDK2 would treat it as BINL and query port 4011.
    pxe = h.handle(client_packet(MessageType.DISCOVER, options=PXE_UEFI), n, LeaseTable(), 1000)
    assert Opt.VENDOR_CLASS not in pxe.reply.options


ops = st.lists(
    st.tuples(
        st.sampled_from(["discover", "request", "renew", "release", "decline"]),
        st.integers(0, 7),  # which of 8 clients (pool has 4 addresses)
        st.integers(0, 5),  # which address it names
        st.integers(0, 400),  # time step
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(ops)
def test_no_address_is_ever_bound_to_two_clients(seq) -> None:  # type: ignore[no-untyped-def]
    h, n, t = FullHandler(SERVER, FILES), net(), LeaseTable()
    now = 1000.0
    for op, c, a, dt in seq:
        now += dt
        mac = f"52:54:00:00:00:{c:02x}"
        ip = IPv4Address(int(n.pool_start) + a)
        if op == "discover":
            pkt = client_packet(MessageType.DISCOVER, mac)
        elif op == "request":
            pkt = client_packet(MessageType.REQUEST, mac, options={Opt.REQUESTED_IP: ip.packed})
        elif op == "renew":
            pkt = client_packet(MessageType.REQUEST, mac, ciaddr=ip)
        elif op == "release":
            pkt = client_packet(MessageType.RELEASE, mac, ciaddr=ip)
        else:
            pkt = client_packet(MessageType.DECLINE, mac, options={Opt.REQUESTED_IP: ip.packed})
        d = h.handle(pkt, n, t, now)
        if d.reply is not None and d.reply.message_type is MessageType.ACK:
            assert d.write is not None and d.write.mac == mac
        # Invariant: every address held at `now` is held by one client, and that client's
        # own index points at it (so the client can never be given a second address too).
        held = [r for r in t.records() if r.holds(now) and r.state is LeaseState.BOUND]
        assert len({r.ip for r in held}) == len(held)
        for r in held:
            assert t.for_mac("prov", r.mac) is r


def test_decide_only_reads_the_table_and_returns_what_to_put() -> None:
    """The core is pure: a decision is a value (records to put, a write, a reply), and the
    table changes only when the caller applies it."""
    h, n, t = FullHandler(SERVER, FILES), net(), LeaseTable()
    _, ack = dora(h, n, t, "52:54:00:00:00:01")
    before = sorted(t.records())
    d = h.decide(client_packet(MessageType.DISCOVER, "52:54:00:00:00:02"), n, t, 1001.0)
    assert sorted(t.records()) == before
    assert [(r.mac, r.state) for r in d.puts] == [("52:54:00:00:00:02", LeaseState.OFFERED)]
    rel = client_packet(MessageType.RELEASE, "52:54:00:00:00:01", ciaddr=ack.reply.yiaddr)
    d = h.decide(rel, n, t, 1002.0)
    assert sorted(t.records()) == before and d.write is not None
    assert d.write.state is LeaseState.RELEASED and d.puts == (d.write,)
    t.apply(d.puts)
    assert t.for_mac("prov", "52:54:00:00:00:01").state is LeaseState.RELEASED


def test_reservations_take_any_mac_spelling_and_refuse_what_is_not_a_mac() -> None:
    ip = IPv4Address("10.0.0.50")
    for spelling in ("52-54-00-00-00-0A", "5254.0000.000a", "525400 00000a".replace(" ", "")):
        assert net(reservations={spelling: ip}).reservations == {"52:54:00:00:00:0a": ip}
    with pytest.raises(ValueError, match="not a MAC address"):
        net(reservations={"52:54:00:00:00": ip})


def test_a_reservation_that_is_not_a_mac_is_a_config_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from metald.config import ConfigError, load_config

    conf = tmp_path / "metald.toml"
    conf.write_text(
        '[[boot.networks]]\nname = "prov"\nsubnet = "10.0.0.0/24"\npool_start = "10.0.0.10"\n'
        'pool_end = "10.0.0.20"\nreservations = { "52:54:00:00:00" = "10.0.0.5" }\n'
    )
    with pytest.raises(ConfigError, match="'52:54:00:00:00' is not a MAC address"):
        load_config(conf, environ={})
    conf.write_text(conf.read_text().replace('"52:54:00:00:00"', '"5254.0000.000A"'))
    net = load_config(conf, environ={}).boot.networks[0]
    assert net.reservations == {"52:54:00:00:00:0a": IPv4Address("10.0.0.5")}


def test_ipxe_is_told_not_to_wait_for_proxydhcp_only_when_the_offer_names_its_script() -> None:
    """iPXE waits 2 s for ProxyDHCP offers unless told no-pxedhcp (option 175, sub-option 176):
    metald's offer and ACK already name the boot script, so iPXE clients get it; a PXE ROM (not
    iPXE) and a client that is not network-booting do not."""
    h, n, t = FullHandler(SERVER, FILES), net(), LeaseTable()
    offer, ack = dora(h, n, t, "52:54:00:00:00:21", options=IPXE_BIOS)
    for d in (offer, ack):
        assert d.reply.options[Opt.BOOTFILE].endswith(b".ipxe")
        assert d.reply.options[175] == bytes((176, 1, 1))
    wire = parse(serialize(ack.reply))  # and it survives the codec as the TLV iPXE reads
    assert wire.options[175] == b"\xb0\x01\x01"
    offer, ack = dora(h, n, t, "52:54:00:00:00:22", options=PXE_BIOS)
    assert 175 not in offer.reply.options and 175 not in ack.reply.options
    offer, ack = dora(h, n, t, "52:54:00:00:00:23")
    assert 175 not in offer.reply.options and 175 not in ack.reply.options
