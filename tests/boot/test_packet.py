"""The DHCPv4 codec against scapy's independent implementation, and under fuzzing."""

from __future__ import annotations

import contextlib
from ipaddress import IPv4Address

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scapy.layers.dhcp import BOOTP, DHCP

from metald.boot.dhcp.packet import (
    MAGIC_COOKIE,
    MalformedPacket,
    MessageType,
    Opt,
    encode_tlv,
    parse,
    serialize,
)

from .dhcp_helpers import IPXE_BIOS, client_packet


def test_parses_what_scapy_builds() -> None:
    raw = bytes(
        BOOTP(chaddr=bytes.fromhex("525400aabbcc"), xid=0xDEADBEEF, flags=0x8000, giaddr="10.1.2.3")
        / DHCP(
            options=[
                ("message-type", "discover"),
                ("requested_addr", "10.0.0.7"),
                ("vendor_class_id", b"PXEClient:Arch:00007:UNDI:003016"),
                (93, b"\x00\x07"),
                (77, b"iPXE"),
                (82, encode_tlv({1: b"eth1/0/7", 2: b"switch-a"})),
                (97, b"\x00" + bytes(range(16))),
                "end",
            ]
        )
    )
    p = parse(raw)
    assert p.message_type is MessageType.DISCOVER
    assert p.mac == "52:54:00:aa:bb:cc"
    assert p.xid == 0xDEADBEEF and p.broadcast
    assert p.giaddr == IPv4Address("10.1.2.3")
    assert p.requested_ip == IPv4Address("10.0.0.7")
    assert p.client_archs == [7]
    assert b"iPXE" in p.user_classes
    assert p.relay_agent == {1: b"eth1/0/7", 2: b"switch-a"}
    assert p.client_uuid == bytes(range(16)).hex()


def test_scapy_reads_what_we_serialize() -> None:
    pkt = client_packet(MessageType.REQUEST, "52:54:00:00:00:09", options=IPXE_BIOS)
    pkt.options[Opt.BOOTFILE] = b"x" * 300  # longer than one option: split (RFC 3396)
    s = BOOTP(serialize(pkt))
    opts = dict(o for o in s[DHCP].options if isinstance(o, tuple))
    assert opts["message-type"] == 3
    assert s.chaddr[:6] == bytes.fromhex("525400000009")
    assert parse(serialize(pkt)).options[Opt.BOOTFILE] == b"x" * 300


def test_overload_reads_options_from_file_and_sname() -> None:
    pkt = client_packet(MessageType.DISCOVER)
    raw = bytearray(serialize(pkt))
    # Option 52 = 3 (file and sname carry options); hostname in file, vendor class in sname.
    raw[240:] = b"\x35\x01\x01\x34\x01\x03\xff"
    raw[108:236] = (b"\x0c\x03abc\xff").ljust(128, b"\x00")
    raw[44:108] = (b"\x3c\x03xyz\xff").ljust(64, b"\x00")
    p = parse(bytes(raw))
    assert p.hostname == "abc" and p.vendor_class == "xyz"
    assert p.file == b"" and p.sname == b""


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: b[:100], "truncated-header"),
        (lambda b: b + b"\x00" * 5000, "oversized"),
        (lambda b: b[:236] + b"XXXX" + b[240:], "no-magic-cookie"),
        (lambda b: b"\x07" + b[1:], "bad-op"),
        (lambda b: b[:2] + b"\x11" + b[3:], "bad-hlen"),
        (lambda b: b[:240] + b"\x35\x01\x01\x0c\x20ab", "truncated-option"),
        (lambda b: b[:240] + b"\x35", "truncated-option"),
        (lambda b: b[:240] + b"\x35\x02\x01\x01\xff", "bad-message-type"),
        (lambda b: b[:240] + b"\x35\x01\x09\xff", "bad-message-type"),
        (lambda b: b[:240] + b"\x35\x01\x01\x34\x01\x07\xff", "bad-overload"),
    ],
)
def test_malformed_packets_have_precise_reasons(mutate, reason: str) -> None:  # type: ignore[no-untyped-def]
    good = serialize(client_packet(MessageType.DISCOVER))
    with pytest.raises(MalformedPacket) as e:
        parse(mutate(good))
    assert e.value.reason == reason


def test_overload_inside_file_cannot_loop() -> None:
    raw = bytearray(serialize(client_packet(MessageType.DISCOVER)))
    raw[240:] = b"\x35\x01\x01\x34\x01\x01\xff"
    raw[108:236] = (b"\x34\x01\x01\x0c\x01a\xff").ljust(128, b"\x00")  # 52 again, in file
    p = parse(bytes(raw))
    assert p.hostname == "a"


_valid = serialize(client_packet(MessageType.DISCOVER, options=IPXE_BIOS))


@settings(max_examples=3000, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.binary(max_size=700))
def test_fuzz_random_bytes_only_raise_malformed(data: bytes) -> None:
    try:
        p = parse(MAGIC_COOKIE.join([data[:236].ljust(236, b"\x00"), data[236:]]))
    except MalformedPacket:
        return
    # Whatever parsed must serialize and reparse to the same options.
    assert parse(serialize(p)).options == p.options


@settings(max_examples=1500, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, len(_valid) - 1), st.integers(0, 255)), max_size=12),
    st.integers(0, len(_valid)),
)
def test_fuzz_mutated_packets_only_raise_malformed(flips, cut) -> None:  # type: ignore[no-untyped-def]
    b = bytearray(_valid)
    for i, v in flips:
        b[i] = v
    try:
        p = parse(bytes(b[:cut] if cut > 240 else b))
        _ = (p.client_archs, p.user_classes, p.vendor_class, p.hostname)
        with contextlib.suppress(MalformedPacket):
            _ = (p.relay_agent, p.requested_ip, p.server_id, p.client_uuid)
    except MalformedPacket:
        pass
