"""The RMCP+ core on its own: both handshake halves, packet sealing, message framing."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metald.bmc import rmcp

GUID = bytes(range(16))


def _handshake(
    client_pw: bytes, server_pw: bytes
) -> tuple[rmcp.ClientHandshake, rmcp.ServerHandshake]:
    c = rmcp.ClientHandshake(b"admin", client_pw)
    s = rmcp.ServerHandshake({b"admin": server_pw}, GUID)
    rakp1 = c.on_open_response(s.on_open_request(c.open_request()))
    rakp3 = c.on_rakp2(s.on_rakp1(rakp1))
    rakp4, keys = s.on_rakp3(rakp3)
    assert keys is not None
    assert c.on_rakp4(rakp4) == keys
    return c, s


def test_handshake_halves_agree_on_keys() -> None:
    c, s = _handshake(b"pw", b"pw")
    assert c.keys == s.keys
    assert c.keys is not None and len(c.keys.aes_key) == 16


def test_wrong_password_is_detected_by_the_client_at_rakp2() -> None:
    c = rmcp.ClientHandshake(b"admin", b"wrong")
    s = rmcp.ServerHandshake({b"admin": b"right"}, GUID)
    rakp1 = c.on_open_response(s.on_open_request(c.open_request()))
    with pytest.raises(rmcp.RmcpAuthError, match="different password"):
        c.on_rakp2(s.on_rakp1(rakp1))


def test_unknown_user_is_an_auth_error() -> None:
    c = rmcp.ClientHandshake(b"nobody", b"pw")
    s = rmcp.ServerHandshake({b"admin": b"pw"}, GUID)
    rakp1 = c.on_open_response(s.on_open_request(c.open_request()))
    with pytest.raises(rmcp.RmcpAuthError, match="unknown user"):
        c.on_rakp2(s.on_rakp1(rakp1))


def test_sealed_packets_round_trip_and_tampering_is_refused() -> None:
    c, _ = _handshake(b"pw", b"pw")
    assert c.keys is not None
    msg = rmcp.encode_request(0x00, 0x01, b"", 5)
    pkt = rmcp.encode_packet(rmcp.PAYLOAD_IPMI, 0x1234, 7, msg, c.keys)
    back = rmcp.decode_packet(pkt, c.keys)
    assert (back.session_id, back.seq, back.payload) == (0x1234, 7, msg)
    assert msg not in pkt  # encrypted on the wire
    bad = bytearray(pkt)
    bad[20] ^= 1
    with pytest.raises(rmcp.RmcpError, match="integrity"):
        rmcp.decode_packet(bytes(bad), c.keys)


def test_request_and_response_framing() -> None:
    req = rmcp.decode_request(rmcp.encode_request(0x00, 0x02, b"\x02", 9))
    assert (req.netfn, req.cmd, req.data, req.rq_seq) == (0, 2, b"\x02", 9)
    rsp = rmcp.decode_response(rmcp.encode_response(req, 0, b"\x01"))
    assert (rsp.netfn, rsp.cmd, rsp.code, rsp.data, rsp.rq_seq) == (1, 2, 0, b"\x01", 9)
    broken = bytearray(rmcp.encode_request(0x00, 0x02, b"\x02", 9))
    broken[-1] ^= 0xFF
    with pytest.raises(rmcp.RmcpError):
        rmcp.decode_request(bytes(broken))


@given(st.binary(max_size=200))
def test_decoding_garbage_only_raises_rmcp_error(data: bytes) -> None:
    keys = rmcp.SessionKeys.from_sik(b"k" * 20)
    for k in (None, keys):
        with contextlib.suppress(rmcp.RmcpError):
            rmcp.decode_packet(rmcp.RMCP_HEADER + b"\x06" + data, k)
