"""The faster DHCP codec and full-mode core against their earlier versions (kept verbatim in
``dhcp_reference``): the same packets (fields and option order) or the same error reason from
``parse``, the same bytes from ``serialize``, the same decisions over sequences of client
packets against one lease table each. Random input; in-process, well under a second."""

from __future__ import annotations

from ipaddress import IPv4Address

from hypothesis import given
from hypothesis import strategies as st

from metald.boot.dhcp.full import FullHandler
from metald.boot.dhcp.leasetable import LeaseTable
from metald.boot.dhcp.packet import (
    DhcpPacket,
    MalformedPacket,
    MessageType,
    Opt,
    parse,
    serialize,
)

from . import dhcp_reference as ref
from .dhcp_helpers import IPXE_BIOS, PXE_UEFI, client_packet
from .test_dhcp_fuzz import CORE_ADDRS, FILES, MACS, SERVER, core_net, datagrams, fuzz_settings


def _outcome(fn, *args):  # type: ignore[no-untyped-def]
    try:
        return "ok", fn(*args)
    except MalformedPacket as e:
        return "malformed", e.reason
    except ValueError as e:  # serialize: a field too long
        return "value-error", str(e)


def _same_packet(a: DhcpPacket, b: DhcpPacket) -> None:
    assert a == b
    assert list(a.options.items()) == list(b.options.items())  # order too: it is on the wire


@fuzz_settings(100)
@given(datagrams())
def test_parse_and_serialize_match_the_reference(data: bytes) -> None:
    new, old = _outcome(parse, data), _outcome(ref.parse, data)
    assert new[0] == old[0]
    if new[0] != "ok":
        assert new == old
        return
    _same_packet(new[1], old[1])
    assert _outcome(serialize, new[1]) == _outcome(ref.serialize, old[1])


values = st.one_of(
    st.binary(max_size=20),
    st.binary(min_size=250, max_size=600),  # split into several instances (RFC 3396)
    st.binary(max_size=8).map(bytearray),  # unhashable: encoded, not cached
)


@fuzz_settings(150)
@given(
    st.lists(st.tuples(st.sampled_from([1, 3, 6, 51, 53, 54, 60, 67, 82, 175, 250]), values)),
    st.sampled_from([300, 0, 240, 576]),
    st.binary(max_size=63),
    st.binary(max_size=127),
)
def test_serialize_matches_the_reference_on_reply_like_packets(
    opts: list[tuple[int, bytes]], min_size: int, sname: bytes, file: bytes
) -> None:
    pkt = DhcpPacket(op=2, xid=7, sname=sname, file=file, options=dict(opts))
    for _ in range(2):  # the second time from the block cache
        assert serialize(pkt, min_size=min_size) == ref.serialize(pkt, min_size=min_size)


POOL = [IPv4Address(a) for a in CORE_ADDRS if a] + [IPv4Address("10.0.0.100")]


@st.composite
def client_messages(draw) -> bytes:  # type: ignore[no-untyped-def]
    """Mostly well-formed client messages on the fuzz network: DORAs, renewals, declines,
    releases, informs, with our server id, another's or a broken one."""
    mtype = draw(
        st.sampled_from(
            [MessageType.DISCOVER, MessageType.REQUEST, MessageType.REQUEST]
            + [MessageType.DECLINE, MessageType.RELEASE, MessageType.INFORM, MessageType.OFFER]
        )
    )
    opts: dict[int, bytes] = {}
    want = draw(st.one_of(st.none(), st.sampled_from(POOL)))
    if want is not None:
        opts[Opt.REQUESTED_IP] = want.packed
    sid = draw(st.sampled_from([None, SERVER.packed, SERVER.packed, b"\x0a\x00\x00\x02", b"\x01"]))
    if sid is not None:
        opts[Opt.SERVER_ID] = sid
    opts.update(draw(st.sampled_from([{}, {}, IPXE_BIOS, PXE_UEFI])))
    if draw(st.booleans()):
        opts[Opt.HOSTNAME] = draw(st.sampled_from([b"node1", b"", b"\xff\xfe"]))
    if draw(st.booleans()):
        opts[Opt.CLIENT_ID] = draw(st.sampled_from([b"\x01RT\x00\x00\x00\x01", b""]))
    if draw(st.booleans()):
        opts[Opt.RELAY_AGENT] = b"\x01\x03eth"
    pkt = client_packet(
        mtype,
        draw(st.sampled_from(MACS)).hex(":"),
        options=opts,
        ciaddr=draw(st.sampled_from([IPv4Address(0), IPv4Address(0), *POOL])),
        giaddr=draw(st.sampled_from([IPv4Address(0), IPv4Address("10.0.0.254")])),
        flags=draw(st.sampled_from([0, 0x8000])),
    )
    return serialize(pkt)


def _same_step(new, old, pkt, net, t_new, t_old, now) -> None:  # type: ignore[no-untyped-def]
    """One packet through the new and the reference core: the same outcome and lease table."""
    a = _outcome(new.handle, pkt, net, t_new, now)
    b = _outcome(old.handle, pkt, net, t_old, now)
    assert a[0] == b[0]
    if a[0] == "ok":
        _same_decision(a[1], b[1])
    else:
        assert a == b
    assert sorted(t_new.records()) == sorted(t_old.records())


def _same_decision(a, b) -> None:  # type: ignore[no-untyped-def]
    assert (a.dest, a.write, a.extra_writes, a.ignored, a.network, a.kind, a.puts) == (
        b.dest,
        b.write,
        b.extra_writes,
        b.ignored,
        b.network,
        b.kind,
        b.puts,
    )
    assert (a.reply is None) == (b.reply is None)
    if a.reply is not None:
        _same_packet(a.reply, b.reply)
        assert serialize(a.reply) == ref.serialize(b.reply)
    assert (a.on_conflict is None) == (b.on_conflict is None)
    if a.on_conflict is not None:
        _same_packet(a.on_conflict(), b.on_conflict())


@fuzz_settings(50)
@given(
    st.lists(
        st.tuples(st.one_of(client_messages(), datagrams()), st.integers(0, 700)),
        min_size=1,
        max_size=16,
    )
)
def test_full_core_decides_as_the_reference(seq) -> None:  # type: ignore[no-untyped-def]
    net = core_net()
    new, old = FullHandler(SERVER, FILES), ref.FullHandler(SERVER, FILES)
    t_new, t_old = LeaseTable(), LeaseTable()
    now = 1000.0
    for data, dt in seq:
        now += dt
        try:
            pkt = parse(data)
        except MalformedPacket:
            continue
        _same_step(new, old, pkt, net, t_new, t_old, now)


def test_full_core_matches_the_reference_on_every_request_variant() -> None:
    """Every REQUEST shape after an offer and after a binding, exhaustively (not by chance):
    the requested address the client's own or another pool address, our server id,
    another's, a broken one or none, ciaddr empty or set."""
    net = core_net()
    mac = MACS[1].hex(":")
    pool = [IPv4Address(a) for a in ("10.0.0.100", "10.0.0.101", "10.0.0.103", "10.0.0.50")]
    sids = [None, SERVER.packed, b"\x0a\x00\x00\x02", b"\x01"]
    cis = [IPv4Address(0), *pool[:2]]
    cases = 0
    for bound in (False, True):
        for want in [None, *pool]:
            for sid in sids:
                for ci in cis:
                    new, old = FullHandler(SERVER, FILES), ref.FullHandler(SERVER, FILES)
                    t_new, t_old = LeaseTable(), LeaseTable()
                    steps = [client_packet(MessageType.DISCOVER, mac)]
                    if bound:  # complete a DORA first: the REQUEST below renews or moves
                        steps.append(
                            client_packet(
                                MessageType.REQUEST,
                                mac,
                                options={
                                    Opt.REQUESTED_IP: pool[0].packed,
                                    Opt.SERVER_ID: SERVER.packed,
                                },
                            )
                        )
                    opts = {} if want is None else {Opt.REQUESTED_IP: want.packed}
                    if sid is not None:
                        opts[Opt.SERVER_ID] = sid
                    steps.append(client_packet(MessageType.REQUEST, mac, options=opts, ciaddr=ci))
                    for i, p in enumerate(steps):
                        pkt = parse(serialize(p))
                        _same_step(new, old, pkt, net, t_new, t_old, 1000.0 + i)
                    cases += 1
    assert cases == 2 * 5 * 4 * 3
