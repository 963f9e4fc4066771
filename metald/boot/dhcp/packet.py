"""DHCPv4 codec (RFC 2131/2132): bytes to ``DhcpPacket`` and back, no I/O.

Parsing is strict about structure (lengths, cookie, option framing) and raises
``MalformedPacket`` with a short, stable ``reason`` that the server counts in /metrics. It is
lenient only where real clients need it: a missing END option, and repeated options, which
RFC 3396 says to concatenate.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from ipaddress import IPv4Address

MAGIC_COOKIE = b"\x63\x82\x53\x63"
#: Fixed BOOTP header (236 bytes) plus the cookie.
HEADER_LEN = 240
#: Largest datagram we accept; bigger is an attack or a bug, never a client.
MAX_PACKET = 4096
ZERO = IPv4Address(0)
BROADCAST_FLAG = 0x8000

_HEADER = struct.Struct("!BBBBIHH4s4s4s4s16s64s128s")


class MalformedPacket(ValueError):
    """The bytes are not a DHCPv4 packet we can act on. ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class Op(IntEnum):
    REQUEST = 1
    REPLY = 2


class MessageType(IntEnum):
    DISCOVER = 1
    OFFER = 2
    REQUEST = 3
    DECLINE = 4
    ACK = 5
    NAK = 6
    RELEASE = 7
    INFORM = 8


class Opt:
    """Option codes (RFC 2132 and later). Plain ints, not an IntEnum: the hot path reads a
    dozen of these per packet and enum attribute access costs 3x a class attribute."""

    PAD = 0
    SUBNET_MASK = 1
    ROUTER = 3
    DNS = 6
    HOSTNAME = 12
    VENDOR_SPECIFIC = 43
    REQUESTED_IP = 50
    LEASE_TIME = 51
    OVERLOAD = 52
    MESSAGE_TYPE = 53
    SERVER_ID = 54
    PARAM_REQUEST = 55
    MESSAGE = 56
    MAX_MESSAGE_SIZE = 57
    RENEWAL_TIME = 58
    REBINDING_TIME = 59
    VENDOR_CLASS = 60
    CLIENT_ID = 61
    TFTP_SERVER = 66
    BOOTFILE = 67
    USER_CLASS = 77
    RELAY_AGENT = 82
    CLIENT_ARCH = 93
    CLIENT_NDI = 94
    CLIENT_UUID = 97
    END = 255


class RelaySub:
    """Option 82 sub-options (RFC 3046, RFC 3527)."""

    CIRCUIT_ID = 1
    REMOTE_ID = 2
    LINK_SELECTION = 5


#: Option 53 value -> type, so the hot path does one dict lookup instead of an enum call.
_MESSAGE_TYPES = {bytes((t,)): t for t in MessageType}
_ZERO_BYTES = b"\x00\x00\x00\x00"


#: Wire address -> IPv4Address, so the relays' giaddr (the same few addresses in every packet)
#: is built once. Bounded: cleared when full, so odd traffic cannot grow it.
_ADDRS: dict[bytes, IPv4Address] = {_ZERO_BYTES: ZERO}
_ADDRS_MAX = 4096


def _addr(raw: bytes) -> IPv4Address:
    # Most header addresses in client packets are 0.0.0.0 or a relay's: reuse those objects.
    a = _ADDRS.get(raw)
    if a is None:
        if len(_ADDRS) >= _ADDRS_MAX:
            _ADDRS.clear()
            _ADDRS[_ZERO_BYTES] = ZERO
        a = _ADDRS[raw] = IPv4Address(raw)
    return a


def _packed(a: IPv4Address) -> bytes:
    # Not a dict cache: IPv4Address hashes in Python (slower than .packed itself).
    return _ZERO_BYTES if a is ZERO else a.packed


@dataclass(slots=True)  # no per-instance __dict__: one object less per packet for the GC
class DhcpPacket:
    op: int = Op.REQUEST
    htype: int = 1
    hlen: int = 6
    hops: int = 0
    xid: int = 0
    secs: int = 0
    flags: int = 0
    ciaddr: IPv4Address = ZERO
    yiaddr: IPv4Address = ZERO
    siaddr: IPv4Address = ZERO
    giaddr: IPv4Address = ZERO
    chaddr: bytes = b"\x00" * 6
    sname: bytes = b""
    file: bytes = b""
    #: Option code -> value, in wire order. Repeated options are concatenated (RFC 3396).
    options: dict[int, bytes] = field(default_factory=dict)

    # -- typed views of the options a server acts on ------------------------------------

    @property
    def message_type(self) -> MessageType | None:
        v = self.options.get(Opt.MESSAGE_TYPE)
        if v is None:
            return None
        mt = _MESSAGE_TYPES.get(v)
        if mt is None:
            raise MalformedPacket("bad-message-type", repr(v))
        return mt

    @property
    def mac(self) -> str:
        return self.chaddr[: self.hlen].hex(":")

    @property
    def broadcast(self) -> bool:
        return bool(self.flags & BROADCAST_FLAG)

    def ip_option(self, code: int) -> IPv4Address | None:
        v = self.options.get(code)
        if v is None:
            return None
        if len(v) != 4:
            raise MalformedPacket("bad-option-length", f"option {code} has {len(v)} bytes, not 4")
        return _addr(v)

    @property
    def requested_ip(self) -> IPv4Address | None:
        return self.ip_option(Opt.REQUESTED_IP)

    @property
    def server_id(self) -> IPv4Address | None:
        return self.ip_option(Opt.SERVER_ID)

    @property
    def client_archs(self) -> list[int]:
        """Option 93: the client's system architectures (RFC 4578), in preference order."""
        v = self.options.get(Opt.CLIENT_ARCH)
        if v is None:
            return []
        if not v or len(v) % 2:
            raise MalformedPacket("bad-option-length", f"option 93 has {len(v)} bytes")
        return [int.from_bytes(v[i : i + 2], "big") for i in range(0, len(v), 2)]

    @property
    def vendor_class(self) -> str:
        return self.options.get(Opt.VENDOR_CLASS, b"").decode("ascii", "replace")

    @property
    def user_classes(self) -> list[bytes]:
        """Option 77. iPXE sends its class as raw text ("iPXE"), RFC 3004 clients as
        length-prefixed items; both readings are returned so either matches."""
        v = self.options.get(Opt.USER_CLASS)
        if not v:
            return []
        items = [v]
        i = 0
        parsed: list[bytes] = []
        while i < len(v):
            n = v[i]
            if n == 0 or i + 1 + n > len(v):
                parsed = []
                break
            parsed.append(v[i + 1 : i + 1 + n])
            i += 1 + n
        return items + parsed

    @property
    def client_uuid(self) -> str | None:
        v = self.options.get(Opt.CLIENT_UUID)
        if v is None:
            return None
        if len(v) != 17 or v[0] != 0:
            raise MalformedPacket("bad-option-length", "option 97 is not type 0 + 16 bytes")
        return v[1:].hex()

    @property
    def relay_agent(self) -> dict[int, bytes] | None:
        """Option 82 sub-options, or None when no relay added it."""
        v = self.options.get(Opt.RELAY_AGENT)
        if v is None:
            return None
        return parse_tlv(v, what="option 82")

    @property
    def hostname(self) -> str | None:
        v = self.options.get(Opt.HOSTNAME)
        return v.decode("ascii", "replace") if v else None


def parse_tlv(data: bytes, *, what: str) -> dict[int, bytes]:
    """Code/length/value items with no PAD or END (option 43 and 82 sub-options)."""
    out: dict[int, bytes] = {}
    i = 0
    while i < len(data):
        if i + 2 > len(data):
            raise MalformedPacket("truncated-option", f"{what}: sub-option header cut off")
        code, n = data[i], data[i + 1]
        if i + 2 + n > len(data):
            raise MalformedPacket("truncated-option", f"{what}: sub-option {code} overruns")
        out[code] = out.get(code, b"") + data[i + 2 : i + 2 + n]
        i += 2 + n
    return out


def _parse_options(data: bytes, out: dict[int, bytes], *, where: str) -> None:
    i, n = 0, len(data)
    while i < n:
        code = data[i]
        if code == 0:  # PAD (literals: a class attribute lookup per option costs)
            i += 1
            continue
        if code == 255:  # END
            return
        if i + 1 >= n:
            raise MalformedPacket("truncated-option", f"{where}: option {code} has no length")
        end = i + 2 + data[i + 1]
        if end > n:
            raise MalformedPacket(
                "truncated-option",
                f"{where}: option {code} claims {data[i + 1]} bytes, {n - i - 2} left",
            )
        if code in out:  # repeated: concatenated (RFC 3396)
            out[code] += data[i + 2 : end]
        else:
            out[code] = data[i + 2 : end]
        i = end
    # No END: tolerated (some ROMs pad the packet with zeros instead).


#: The fixed header up to chaddr (44 bytes); sname and file are sliced only when used.
_HEAD = struct.Struct("!BBBBIHH4s4s4s4s16s")
_SNAME, _FILE = slice(44, 108), slice(108, 236)


def _cstr(field: bytes) -> bytes:
    return field.split(b"\x00", 1)[0] if field[:1] != b"\x00" else b""


def parse(data: bytes) -> DhcpPacket:
    """Decode one DHCPv4 datagram. Raises ``MalformedPacket``."""
    n = len(data)
    if n > MAX_PACKET:
        raise MalformedPacket("oversized", f"{n} bytes")
    if n < HEADER_LEN:
        raise MalformedPacket("truncated-header", f"{n} bytes")
    if data[236:240] != MAGIC_COOKIE:
        raise MalformedPacket("no-magic-cookie")
    (op, htype, hlen, hops, xid, secs, flags, ci, yi, si, gi, chaddr) = _HEAD.unpack_from(data)
    if op != 1 and op != 2:
        raise MalformedPacket("bad-op", str(op))
    if hlen > 16:
        raise MalformedPacket("bad-hlen", str(hlen))
    options: dict[int, bytes] = {}
    _parse_options(data[HEADER_LEN:], options, where="options")
    overload = options.pop(Opt.OVERLOAD, None)
    if overload is None:
        # Most packets leave both fields empty: look at their first byte before slicing.
        sname = data[_SNAME].split(b"\x00", 1)[0] if data[44] else b""
        file = data[_FILE].split(b"\x00", 1)[0] if data[108] else b""
    else:
        # Options continued in the file and/or sname fields. Those fields are parsed once
        # each and an OVERLOAD inside them is ignored, so overload cannot loop.
        if len(overload) != 1 or overload[0] not in (1, 2, 3):
            raise MalformedPacket("bad-overload", repr(overload))
        sname, file = data[_SNAME], data[_FILE]
        if overload[0] & 1:
            _parse_options(file, options, where="file")
            file = b""
        if overload[0] & 2:
            _parse_options(sname, options, where="sname")
            sname = b""
        options.pop(Opt.OVERLOAD, None)
        sname, file = _cstr(sname), _cstr(file)
    get = _ADDRS.get  # header addresses: mostly 0.0.0.0 or a relay's, built once (_addr)
    # Positional: field order of DhcpPacket (keywords cost measurably per packet).
    pkt = DhcpPacket(
        op,
        htype,
        hlen,
        hops,
        xid,
        secs,
        flags,
        get(ci) or _addr(ci),
        get(yi) or _addr(yi),
        get(si) or _addr(si),
        get(gi) or _addr(gi),
        chaddr,
        sname,
        file,
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


#: (code, value) -> encoded option, for the values replies repeat (message type, server id,
#: lease times, network options): one dict lookup instead of building bytes. Bounded.
_ENCODED: dict[tuple[int, bytes], bytes] = {}
_ENCODED_MAX = 4096
_CACHE_VALUE_MAX = 16


def _encoded(code: int, value: bytes) -> bytes:
    if len(value) > _CACHE_VALUE_MAX or type(value) is not bytes:
        return _encode_option(code, value)
    key = (code, value)
    enc = _ENCODED.get(key)
    if enc is None:
        if len(_ENCODED) >= _ENCODED_MAX:
            _ENCODED.clear()
        enc = _ENCODED[key] = bytes((code, len(value))) + value
    return enc


#: A reply's options (as ``tuple(options.items())``) -> everything after the fixed header:
#: cookie, options, END, padding to 300 bytes. Replies repeat a few option sets (per network
#: and message type), so a reply's options cost one lookup instead of one per option.
#: Bounded: cleared when full (per-client values such as an iPXE script URL only churn it).
_BLOCKS: dict[tuple[tuple[int, bytes], ...], bytes] = {}
_BLOCKS_MAX = 1024
_BLOCK_PAD_TO = 300 - 236


def _options_block(opts: dict[int, bytes], pad_to: int = _BLOCK_PAD_TO) -> bytes:
    parts = [MAGIC_COOKIE]
    mt = opts.get(Opt.MESSAGE_TYPE)
    if mt is not None:
        parts.append(_encoded(Opt.MESSAGE_TYPE, mt))
    for code, value in opts.items():
        if code != Opt.MESSAGE_TYPE:
            parts.append(_encoded(code, value))
    parts.append(b"\xff")
    block = b"".join(parts)
    return block if len(block) >= pad_to else block + bytes(pad_to - len(block))


def _fast_serialize() -> Callable[[DhcpPacket, type], bytes | None] | None:
    """The C encoder (``_codec.c``, built by setup.py where a compiler is there) or None."""
    try:
        from metald.boot.dhcp._codec import serialize300  # type: ignore[import-not-found]
    except ImportError:
        return None
    fn: Callable[[DhcpPacket, type], bytes | None] = serialize300
    return fn


#: ``serialize`` in C for the well-typed packets the server builds (the same bytes; anything
#: else, and every error, is Python's below). None where the extension is not built.
FAST_SERIALIZE = _fast_serialize()


def serialize(pkt: DhcpPacket, *, min_size: int = 300) -> bytes:
    """Encode a packet. Message type goes first (some ROMs expect it there); the result is
    padded to ``min_size`` because old BOOTP relays and clients drop shorter datagrams."""
    if min_size == 300 and FAST_SERIALIZE is not None:
        out = FAST_SERIALIZE(pkt, IPv4Address)
        if out is not None:
            return out
    return serialize_py(pkt, min_size=min_size)


def serialize_py(pkt: DhcpPacket, *, min_size: int = 300) -> bytes:
    """``serialize`` in Python: the reference, and the path for what C leaves to it."""
    sname, file, chaddr, opts = pkt.sname, pkt.file, pkt.chaddr, pkt.options
    if len(sname) > 63 or len(file) > 127:
        raise ValueError("sname or file too long for the fixed fields")
    block: bytes | None
    if min_size != 300:  # padded below instead (the cached blocks are padded for 300)
        key, block = None, _options_block(opts, 0)
    else:
        try:
            key = tuple(opts.items())
            block = _BLOCKS.get(key)
        except TypeError:  # an unhashable value (bytearray): encoded, not cached
            key, block = None, _options_block(opts)
    if block is None:
        block = _options_block(opts)
        if key is not None:  # an encoding of unhashable values is not cached
            if len(_BLOCKS) >= _BLOCKS_MAX:
                _BLOCKS.clear()
            _BLOCKS[key] = block
    out = (
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
            sname,
            file,
        )
        + block
    )
    # A cached block is padded to 300 bytes of packet already.
    return out if len(out) >= min_size else out + bytes(min_size - len(out))


def encode_tlv(items: dict[int, bytes]) -> bytes:
    return b"".join(bytes((k, len(v))) + v for k, v in items.items())


def mac_to_bytes(mac: str) -> bytes:
    return bytes.fromhex(mac.replace(":", "").replace("-", ""))
