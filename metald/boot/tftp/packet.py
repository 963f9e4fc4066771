"""TFTP packets and option negotiation. Pure: bytes in, values or bytes out."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum


class Opcode(IntEnum):
    RRQ = 1
    WRQ = 2
    DATA = 3
    ACK = 4
    ERROR = 5
    OACK = 6


class ErrorCode(IntEnum):
    UNDEFINED = 0
    NOT_FOUND = 1
    ACCESS_VIOLATION = 2
    DISK_FULL = 3
    ILLEGAL_OPERATION = 4
    UNKNOWN_TID = 5
    FILE_EXISTS = 6
    NO_SUCH_USER = 7
    OPTION_REFUSED = 8


class MalformedTftp(ValueError):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


#: RFC 1350 and 2347: a request fits in 512 bytes. A little slack for clients that pad.
MAX_REQUEST = 1024
MIN_BLKSIZE, MAX_BLKSIZE = 8, 65464
MAX_WINDOW = 64
#: Bytes in flight per window (blksize x windowsize): bounds what one ACK can make us send.
MAX_WINDOW_BYTES = 64 << 10
#: RFC 2349 timeouts above this are ignored (not echoed): a client cannot make a transfer
#: that it never acknowledges live for minutes (255 s x retries).
MAX_TIMEOUT = 5


@dataclass(frozen=True)
class Request:
    opcode: Opcode
    filename: str
    mode: str
    #: Lower-cased option name -> value, in the order sent.
    options: dict[str, str]


def parse_request(data: bytes) -> Request:
    if len(data) > MAX_REQUEST:
        raise MalformedTftp("oversized", f"{len(data)} bytes")
    if len(data) < 4:
        raise MalformedTftp("truncated")
    op = int.from_bytes(data[:2], "big")
    if op not in (Opcode.RRQ, Opcode.WRQ):
        raise MalformedTftp("not-a-request", str(op))
    if data[-1] != 0:
        raise MalformedTftp("unterminated")
    fields = data[2:-1].split(b"\x00")
    if len(fields) < 2 or len(fields) % 2:
        raise MalformedTftp("bad-fields", f"{len(fields)} fields")
    try:
        text = [f.decode("ascii") for f in fields]
    except UnicodeDecodeError:
        raise MalformedTftp("not-ascii") from None
    filename, mode = text[0], text[1].lower()
    if not filename:
        raise MalformedTftp("empty-filename")
    if mode not in ("octet", "netascii"):
        raise MalformedTftp("bad-mode", mode)
    options: dict[str, str] = {}
    for i in range(2, len(text), 2):
        name = text[i].lower()
        if not name or name in options:
            raise MalformedTftp("bad-option", name)
        options[name] = text[i + 1]
    return Request(Opcode(op), filename, mode, options)


def parse_ack_or_error(data: bytes) -> tuple[Opcode, int, str]:
    """(ACK, block, "") or (ERROR, code, message)."""
    if len(data) < 4:
        raise MalformedTftp("truncated")
    op, n = struct.unpack_from("!HH", data)
    if op == Opcode.ACK:
        return Opcode.ACK, n, ""
    if op == Opcode.ERROR:
        return Opcode.ERROR, n, data[4:].split(b"\x00", 1)[0].decode("ascii", "replace")
    raise MalformedTftp("unexpected-opcode", str(op))


@dataclass(frozen=True)
class Negotiated:
    blksize: int = 512
    timeout: float = 1.0
    windowsize: int = 1
    #: Options to echo in the OACK (empty: no OACK, plain RFC 1350 transfer).
    oack: dict[str, str] | None = None


def negotiate(
    options: dict[str, str],
    size: int,
    *,
    default_timeout: float = 1.0,
    max_blksize: int = MAX_BLKSIZE,
) -> Negotiated:
    """Accept what we support, clamp to our limits, ignore the rest (RFC 2347).

    blksize and windowsize may be lowered in the OACK (RFC 2348, 7440); timeout may not
    (RFC 2349: the OACK must echo the client's value), so one over ``MAX_TIMEOUT`` is ignored.
    The window is shrunk so that blksize x windowsize stays within ``MAX_WINDOW_BYTES``.
    """
    acc: dict[str, str] = {}
    blksize, timeout, window = 512, default_timeout, 1
    v = options.get("blksize")
    if v is not None and v.isdigit() and int(v) >= MIN_BLKSIZE:
        blksize = min(int(v), max_blksize)
        acc["blksize"] = str(blksize)
    v = options.get("tsize")
    if v is not None and v.isdigit():
        acc["tsize"] = str(size)
    v = options.get("timeout")
    if v is not None and v.isdigit() and 1 <= int(v) <= MAX_TIMEOUT:
        timeout = float(v)
        acc["timeout"] = v
    v = options.get("windowsize")
    if v is not None and v.isdigit() and int(v) >= 1:
        window = max(1, min(int(v), MAX_WINDOW, MAX_WINDOW_BYTES // blksize))
        acc["windowsize"] = str(window)
    return Negotiated(blksize, timeout, window, acc or None)


def data_packet(block: int, payload: bytes) -> bytes:
    return struct.pack("!HH", Opcode.DATA, block & 0xFFFF) + payload


def oack_packet(options: dict[str, str]) -> bytes:
    body = b"".join(k.encode() + b"\x00" + v.encode() + b"\x00" for k, v in options.items())
    return struct.pack("!H", Opcode.OACK) + body


def error_packet(code: ErrorCode, message: str) -> bytes:
    return struct.pack("!HH", Opcode.ERROR, code) + message.encode("ascii", "replace") + b"\x00"


def to_netascii(data: bytes) -> bytes:
    return data.replace(b"\r", b"\r\x00").replace(b"\n", b"\r\n")
