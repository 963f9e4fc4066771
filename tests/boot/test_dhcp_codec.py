"""The C reply encoder (``metald.boot.dhcp._codec.serialize300``) against Python's
``serialize_py``: the same bytes for every packet it encodes, and None (Python's path, with
its errors) for everything it does not: out-of-range or oddly typed fields, long sname or
file, option codes or values that are not ints and bytes, replies too long for its buffer."""

from __future__ import annotations

import shutil
import sysconfig
from ipaddress import IPv4Address
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metald.boot.dhcp import packet
from metald.boot.dhcp.packet import DhcpPacket, MessageType, parse, serialize, serialize_py

from .dhcp_helpers import client_packet


def test_the_extension_is_built_where_it_can_be() -> None:
    have_headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    if not (have_headers and shutil.which("cc")):
        pytest.skip("no C compiler or Python headers: Python's encoder is the only one")
    assert packet.FAST_SERIALIZE is not None


needs_c = pytest.mark.skipif(packet.FAST_SERIALIZE is None, reason="_codec not built")

addrs = st.one_of(
    st.just(packet.ZERO),
    st.integers(0, 2**32 - 1).map(IPv4Address),
    st.just("10.0.0.1"),  # not an IPv4Address: Python's path (which raises)
)
small = st.one_of(st.integers(0, 255), st.integers(-3, 300), st.just(True))
values = st.one_of(
    st.binary(max_size=20),
    st.binary(min_size=250, max_size=700),
    st.just(bytearray(b"ab")),
    st.just("text"),
)
options = st.dictionaries(
    st.one_of(st.integers(0, 255), st.integers(-2, 300), st.just(53)), values, max_size=12
)


@needs_c
@settings(max_examples=600, deadline=None)
@given(
    op=small,
    htype=small,
    hlen=small,
    hops=small,
    xid=st.one_of(st.integers(0, 2**32 - 1), st.integers(-1, 2**33)),
    secs=st.one_of(st.integers(0, 65535), st.integers(-1, 70000)),
    flags=st.sampled_from([0, 0x8000, 65535, 65536]),
    ci=addrs,
    yi=addrs,
    si=addrs,
    gi=addrs,
    chaddr=st.binary(max_size=20),
    sname=st.binary(max_size=70),
    file=st.binary(max_size=140),
    opts=options,
    many=st.integers(0, 20),
)
def test_c_encodes_exactly_as_python_or_leaves_it_to_python(
    op: object,
    htype: object,
    hlen: object,
    hops: object,
    xid: int,
    secs: int,
    flags: int,
    ci: object,
    yi: object,
    si: object,
    gi: object,
    chaddr: bytes,
    sname: bytes,
    file: bytes,
    opts: dict[int, object],
    many: int,
) -> None:
    if many > 17:  # some replies too long for the C buffer (4,096 bytes)
        opts = {**opts, **{200 + i: bytes(255) for i in range(many)}}
    pkt = DhcpPacket(
        op, htype, hlen, hops, xid, secs, flags, ci, yi, si, gi, chaddr, sname, file, opts
    )  # type: ignore[arg-type]
    try:
        want: bytes | type[BaseException] = serialize_py(pkt)
    except Exception as e:  # noqa: BLE001 - compared below
        want = type(e)
    assert packet.FAST_SERIALIZE is not None
    got = packet.FAST_SERIALIZE(pkt, IPv4Address)
    if got is not None:
        assert got == want
    try:
        through = serialize(pkt)
    except Exception as e:  # noqa: BLE001
        assert type(e) is want
    else:
        assert through == want


@needs_c
def test_the_replies_the_server_builds_go_through_c() -> None:
    """A reply like the server's (typed fields, bytes options) is encoded in C, and parses
    back to what was encoded; a packet that is not one at all gets Python's error."""
    pkt = client_packet(MessageType.OFFER, "52:54:00:12:34:56", giaddr=IPv4Address("10.0.0.1"))
    pkt.op, pkt.yiaddr = 2, IPv4Address("10.0.1.7")
    assert packet.FAST_SERIALIZE is not None
    raw = packet.FAST_SERIALIZE(pkt, IPv4Address)
    assert raw is not None and raw == serialize_py(pkt) and len(raw) == 300
    back = parse(raw)
    assert (back.yiaddr, back.giaddr, back.mac) == (pkt.yiaddr, pkt.giaddr, pkt.mac)
    assert packet.FAST_SERIALIZE(object(), IPv4Address) is None
    with pytest.raises(AttributeError):
        serialize(object())  # type: ignore[arg-type]


@needs_c
@settings(max_examples=400, deadline=None)
@given(
    head=st.tuples(*[st.integers(0, 255)] * 4),
    xid=st.integers(0, 2**32 - 1),
    secs=st.integers(0, 65535),
    flags=st.integers(0, 65535),
    ips=st.lists(st.integers(0, 2**32 - 1).map(IPv4Address), min_size=4, max_size=4),
    chaddr=st.binary(max_size=20),
    sname=st.binary(max_size=63),
    file=st.binary(max_size=127),
    opts=st.dictionaries(
        st.integers(0, 255),
        st.one_of(st.binary(max_size=20), st.binary(min_size=250, max_size=600)),
        max_size=6,
    ),
)
def test_every_well_typed_reply_is_encoded_in_c_exactly_as_in_python(
    head: tuple[int, int, int, int],
    xid: int,
    secs: int,
    flags: int,
    ips: list[IPv4Address],
    chaddr: bytes,
    sname: bytes,
    file: bytes,
    opts: dict[int, bytes],
) -> None:
    pkt = DhcpPacket(*head, xid, secs, flags, *ips, chaddr, sname, file, opts)
    assert packet.FAST_SERIALIZE is not None
    got = packet.FAST_SERIALIZE(pkt, IPv4Address)
    assert got is not None and got == serialize_py(pkt)
