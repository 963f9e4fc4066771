"""metalctl's console escapes (ssh's rule: ``~`` only first on a line)."""

from __future__ import annotations

from metald.metalctl.console import EscapeParser
from metald.metalctl.main import build_parser


def test_tilde_dot_after_enter_leaves_and_sends_what_came_before() -> None:
    assert EscapeParser().feed(b"ls\r~.") == [("send", b"ls\r"), ("quit", b"")]


def test_tilde_dot_at_the_very_start_leaves() -> None:
    assert EscapeParser().feed(b"~.") == [("quit", b"")]


def test_a_tilde_inside_a_line_is_typed() -> None:
    assert EscapeParser().feed(b"cd ~.ssh") == [("send", b"cd ~.ssh")]


def test_escapes_split_across_reads() -> None:
    p = EscapeParser()
    assert p.feed(b"x\r") == [("send", b"x\r")]
    assert p.feed(b"~") == []
    assert p.feed(b"B") == [("break", b"")]
    assert p.feed(b"\r~~") == [("send", b"\r~")]
    assert p.feed(b"\r~?") == [("send", b"\r"), ("help", b"")]


def test_an_unknown_escape_is_typed_as_is() -> None:
    assert EscapeParser().feed(b"~x") == [("send", b"~x")]


def test_the_command_is_under_machines() -> None:
    args = build_parser().parse_args(["machines", "console", "node0", "--read-only"])
    assert (args.id, args.mode) == ("node0", "read")
    assert build_parser().parse_args(["machines", "console", "n"]).mode == "auto"


def test_ws_frames_round_trip_masked_and_fragmented() -> None:
    from metald.metalctl.wsclient import OP_BINARY, OP_PING, FrameReader, encode_frame

    payload = bytes(range(256)) * 300  # over 65535 bytes: a 64-bit length
    frame = encode_frame(OP_BINARY, payload, mask=b"\x01\x02\x03\x04")
    assert frame[1] & 0x80 and frame[1] & 0x7F == 127  # masked, 64-bit length
    r = FrameReader()
    got = []
    for i in range(0, len(frame), 1000):  # arrives in pieces
        got += r.feed(frame[i : i + 1000])
    assert [(m.opcode, m.data) for m in got] == [(OP_BINARY, payload)]
    # Server frames are unmasked; a ping between fragments passes through at once.
    first = bytes([0x02, 3]) + b"abc"
    ping = bytes([0x80 | OP_PING, 1]) + b"p"
    last = bytes([0x80, 2]) + b"de"
    assert [(m.opcode, m.data) for m in r.feed(first + ping + last)] == [
        (OP_PING, b"p"),
        (OP_BINARY, b"abcde"),
    ]
