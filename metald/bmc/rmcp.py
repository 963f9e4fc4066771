"""IPMI 2.0 RMCP+ over UDP as a pure core: bytes in, bytes and decisions out, no sockets.

Only what fleet power control needs: cipher suites 17 (RAKP-HMAC-SHA256, HMAC-SHA256-128,
AES-CBC-128), which hardened BMCs require, and 3 (RAKP-HMAC-SHA1, HMAC-SHA1-96, AES-CBC-128),
which every IPMI 2.0 BMC supports, and plain IPMI request/response messages inside the
session. Both ends of the handshake live here:
the client is metald's ``ipmi`` driver, the server is the benchmark's simulated BMC fleet.
Section numbers refer to the IPMI v2.0 rev 1.1 specification.
"""

from __future__ import annotations

import hmac
import os
import struct
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

RMCP_HEADER = b"\x06\x00\xff\x07"  # version 6, reserved, no RMCP ack, class IPMI
AUTH_RMCPP = 0x06

PAYLOAD_IPMI = 0x00
PAYLOAD_OPEN_REQ = 0x10
PAYLOAD_OPEN_RSP = 0x11
PAYLOAD_RAKP1 = 0x12
PAYLOAD_RAKP2 = 0x13
PAYLOAD_RAKP3 = 0x14
PAYLOAD_RAKP4 = 0x15

ENCRYPTED = 0x80
AUTHENTICATED = 0x40

BMC_ADDR = 0x20
CONSOLE_ADDR = 0x81
ROLE_ADMIN = 0x04
NAME_ONLY_LOOKUP = 0x10

#: RMCP+ status codes (table 13-15) that mean the credentials were refused.
AUTH_STATUS = {
    0x02: "unauthorized role or privilege level requested",
    0x09: "unauthorized name",
    0x0D: "invalid name length or unknown user",
    0x0E: "unauthorized name",
    0x0F: "invalid integrity check value",
    0x12: "unauthorized role or privilege level requested",
}

#: Completion codes worth naming in an error (table 5-2).
COMPLETION = {
    0xC0: "node busy",
    0xC1: "invalid command",
    0xC3: "timeout",
    0xC7: "request data length invalid",
    0xC9: "parameter out of range",
    0xCC: "invalid data field in request",
    0xD4: "insufficient privilege level",
    0xD5: "command not supported in present state",
    0xFF: "unspecified error",
}


@dataclass(frozen=True)
class CipherSuite:
    """One cipher suite: its algorithm records (open-session payloads, tables 13-16..13-19)
    and the hash every HMAC of it uses."""

    id: int
    records: bytes
    digest: str
    #: Bytes of the RAKP4 integrity check value and of each packet's AuthCode.
    icv_len: int


SUITE_3 = CipherSuite(
    3,
    bytes(
        [0, 0, 0, 8, 1, 0, 0, 0]  # authentication: RAKP-HMAC-SHA1
        + [1, 0, 0, 8, 1, 0, 0, 0]  # integrity: HMAC-SHA1-96
        + [2, 0, 0, 8, 1, 0, 0, 0]  # confidentiality: AES-CBC-128
    ),
    "sha1",
    12,
)
SUITE_17 = CipherSuite(
    17,
    bytes(
        [0, 0, 0, 8, 3, 0, 0, 0]  # authentication: RAKP-HMAC-SHA256
        + [1, 0, 0, 8, 4, 0, 0, 0]  # integrity: HMAC-SHA256-128
        + [2, 0, 0, 8, 1, 0, 0, 0]  # confidentiality: AES-CBC-128
    ),
    "sha256",
    16,
)
SUITES = {3: SUITE_3, 17: SUITE_17}
#: RMCP+ status codes (table 13-15) that refuse the proposed algorithms, not the user.
SUITE_STATUS = {0x04, 0x05, 0x06, 0x07, 0x10, 0x11}


class RmcpError(Exception):
    """A packet that cannot be used: malformed, failed integrity, or not for this session."""


class RmcpAuthError(RmcpError):
    """The BMC refused the credentials, or proved it holds a different password."""


class SuiteRefused(RmcpError):
    """The BMC does not offer the cipher suite proposed (a client may propose another)."""


def _hmac(key: bytes, data: bytes, digest: str = "sha1") -> bytes:
    # The one-shot C path: hmac.new() builds two hash objects in Python, ~40x slower here.
    return hmac.digest(key, data, digest)


def checksum(data: bytes) -> int:
    """IPMI two's-complement checksum: data plus checksum sums to 0 mod 256."""
    return (-sum(data)) & 0xFF


@dataclass(frozen=True)
class Packet:
    payload_type: int
    session_id: int
    seq: int
    payload: bytes


@dataclass
class SessionKeys:
    """Keys of an established session, shared by both directions (section 13.32)."""

    k1: bytes
    aes_key: bytes
    digest: str = "sha1"
    #: Bytes of each packet's AuthCode (HMAC-SHA1-96: 12, HMAC-SHA256-128: 16).
    mac_len: int = 12

    @classmethod
    def from_sik(cls, sik: bytes, suite: CipherSuite = SUITE_3) -> SessionKeys:
        # Const1/Const2 are 20 bytes whatever the hash (section 13.32; pyghmi agrees).
        d = suite.digest
        return cls(_hmac(sik, b"\x01" * 20, d), _hmac(sik, b"\x02" * 20, d)[:16], d, suite.icv_len)


def encode_packet(
    payload_type: int, session_id: int, seq: int, payload: bytes, keys: SessionKeys | None = None
) -> bytes:
    """One RMCP+ datagram; with ``keys`` the payload is encrypted and the packet signed."""
    if keys is None:
        header = struct.pack("<BBIIH", AUTH_RMCPP, payload_type, session_id, seq, len(payload))
        return RMCP_HEADER + header + payload
    iv = os.urandom(16)
    pad_len = (16 - (len(payload) + 1) % 16) % 16
    plain = payload + bytes(range(1, pad_len + 1)) + bytes([pad_len])
    enc = Cipher(algorithms.AES(keys.aes_key), modes.CBC(iv)).encryptor()
    body = iv + enc.update(plain) + enc.finalize()
    ptype = payload_type | ENCRYPTED | AUTHENTICATED
    signed = struct.pack("<BBIIH", AUTH_RMCPP, ptype, session_id, seq, len(body)) + body
    # Integrity pad makes (signed + pad + pad length + next header) a multiple of 4.
    ipad = (4 - (len(signed) + 2) % 4) % 4
    signed += b"\xff" * ipad + bytes([ipad, 0x07])
    return RMCP_HEADER + signed + _hmac(keys.k1, signed, keys.digest)[: keys.mac_len]


def decode_packet(data: bytes, keys: SessionKeys | None = None) -> Packet:
    """Parse, check integrity and decrypt; raises RmcpError on anything unusable."""
    if len(data) < 16 or data[:4] != RMCP_HEADER or data[4] != AUTH_RMCPP:
        raise RmcpError("not an RMCP+ packet")
    ptype, session_id, seq, length = struct.unpack_from("<BIIH", data, 5)
    body = data[16 : 16 + length]
    if len(body) != length:
        raise RmcpError("truncated payload")
    if ptype & AUTHENTICATED:
        if keys is None:
            raise RmcpError("signed packet outside a session")
        signed_end = len(data) - keys.mac_len
        if signed_end < 16 + length + 2:
            raise RmcpError("truncated integrity trailer")
        mac = _hmac(keys.k1, data[4:signed_end], keys.digest)[: keys.mac_len]
        if not hmac.compare_digest(mac, data[signed_end:]):
            raise RmcpError("integrity check failed")
    if ptype & ENCRYPTED:
        if keys is None or length < 32 or (length - 16) % 16:
            raise RmcpError("bad encrypted payload")
        dec = Cipher(algorithms.AES(keys.aes_key), modes.CBC(body[:16])).decryptor()
        plain = dec.update(body[16:]) + dec.finalize()
        body = plain[: len(plain) - 1 - plain[-1]]
    return Packet(ptype & 0x3F, session_id, seq, bytes(body))


# --- IPMI messages inside the session (section 13.8) ---


@dataclass(frozen=True)
class IpmiRequest:
    netfn: int
    cmd: int
    data: bytes
    rq_seq: int


@dataclass(frozen=True)
class IpmiResponse:
    netfn: int
    cmd: int
    code: int
    data: bytes
    rq_seq: int


def encode_request(netfn: int, cmd: int, data: bytes, rq_seq: int) -> bytes:
    head = bytes([BMC_ADDR, netfn << 2])
    body = bytes([CONSOLE_ADDR, (rq_seq & 0x3F) << 2, cmd]) + data
    return head + bytes([checksum(head)]) + body + bytes([checksum(body)])


def decode_request(msg: bytes) -> IpmiRequest:
    if len(msg) < 7 or checksum(msg[:2]) != msg[2] or checksum(msg[3:-1]) != msg[-1]:
        raise RmcpError("bad IPMI request")
    return IpmiRequest(netfn=msg[1] >> 2, cmd=msg[5], data=msg[6:-1], rq_seq=msg[4] >> 2)


def encode_response(req: IpmiRequest, code: int, data: bytes = b"") -> bytes:
    head = bytes([CONSOLE_ADDR, (req.netfn | 1) << 2])
    body = bytes([BMC_ADDR, (req.rq_seq & 0x3F) << 2, req.cmd, code]) + data
    return head + bytes([checksum(head)]) + body + bytes([checksum(body)])


def decode_response(msg: bytes) -> IpmiResponse:
    if len(msg) < 8 or checksum(msg[:2]) != msg[2] or checksum(msg[3:-1]) != msg[-1]:
        raise RmcpError("bad IPMI response")
    return IpmiResponse(
        netfn=msg[1] >> 2, cmd=msg[5], code=msg[6], data=msg[7:-1], rq_seq=msg[4] >> 2
    )


# --- The RAKP handshake (sections 13.17-13.31) ---


@dataclass
class ClientHandshake:
    """Client side: open session, RAKP1..4. Each ``on_*`` takes a payload, returns the next."""

    username: bytes
    password: bytes = field(repr=False)
    console_sid: bytes = field(default_factory=lambda: os.urandom(4))
    tag: int = 0
    rm: bytes = field(default_factory=lambda: os.urandom(16), repr=False)
    role: int = ROLE_ADMIN | NAME_ONLY_LOOKUP
    bmc_sid: bytes = b""
    rc: bytes = field(default=b"", repr=False)
    guid: bytes = b""
    keys: SessionKeys | None = field(default=None, repr=False)
    suite: CipherSuite = SUITE_3

    def __post_init__(self) -> None:
        if len(self.username) > 16 or len(self.password) > 20:
            raise ValueError("IPMI user names are at most 16 bytes and passwords 20")

    def _mac(self, key: bytes, data: bytes) -> bytes:
        return _hmac(key, data, self.suite.digest)

    def open_request(self) -> bytes:
        return bytes([self.tag, ROLE_ADMIN, 0, 0]) + self.console_sid + self.suite.records

    def on_open_response(self, p: bytes) -> bytes:
        if len(p) < 2 or p[0] != self.tag:
            raise RmcpError("open-session response for another request")
        if p[1] != 0:
            raise _status_error("open session", p[1])
        if len(p) < 36 or p[4:8] != self.console_sid:
            raise RmcpError("malformed open-session response")
        if p[12:36] != self.suite.records:
            # Never a silent downgrade: the caller decides whether to try another suite.
            raise SuiteRefused(f"BMC did not accept cipher suite {self.suite.id}")
        self.bmc_sid = p[8:12]
        return (
            bytes([self.tag, 0, 0, 0])
            + self.bmc_sid
            + self.rm
            + bytes([self.role, 0, 0, len(self.username)])
            + self.username
        )

    def on_rakp2(self, p: bytes) -> bytes:
        if len(p) < 2 or p[0] != self.tag:
            raise RmcpError("RAKP2 for another request")
        if p[1] != 0:
            raise _status_error("RAKP2", p[1])
        if len(p) < 60 or p[4:8] != self.console_sid:
            raise RmcpError("malformed RAKP2")
        self.rc, self.guid = p[8:24], p[24:40]
        ident = bytes([self.role, len(self.username)]) + self.username
        expect = self._mac(
            self.password, self.console_sid + self.bmc_sid + self.rm + self.rc + self.guid + ident
        )
        if not hmac.compare_digest(expect, p[40 : 40 + len(expect)]):
            raise RmcpAuthError("the BMC holds a different password for this user")
        sik = self._mac(self.password, self.rm + self.rc + ident)  # Kg unset: Kuid stands in
        self.keys = SessionKeys.from_sik(sik, self.suite)
        self._sik = sik
        auth = self._mac(self.password, self.rc + self.console_sid + ident)
        return bytes([self.tag, 0, 0, 0]) + self.bmc_sid + auth

    def on_rakp4(self, p: bytes) -> SessionKeys:
        if len(p) < 2 or p[0] != self.tag:
            raise RmcpError("RAKP4 for another request")
        if p[1] != 0:
            raise _status_error("RAKP4", p[1])
        n = self.suite.icv_len
        if len(p) < 8 + n or self.keys is None:
            raise RmcpError("malformed RAKP4")
        expect = self._mac(self._sik, self.rm + self.bmc_sid + self.guid)[:n]
        if not hmac.compare_digest(expect, p[8 : 8 + n]):
            raise RmcpAuthError("RAKP4 integrity check failed (wrong BMC key?)")
        return self.keys


def _status_error(step: str, status: int) -> RmcpError:
    if status in SUITE_STATUS:
        return SuiteRefused(f"{step} refused the cipher suite (RMCP+ status 0x{status:02x})")
    if status in AUTH_STATUS:
        return RmcpAuthError(f"{step} refused: {AUTH_STATUS[status]}")
    return RmcpError(f"{step} refused with RMCP+ status 0x{status:02x}")


@dataclass
class ServerHandshake:
    """BMC side of the handshake, for simulators. ``users`` maps user name to password."""

    users: dict[bytes, bytes] = field(repr=False)
    guid: bytes
    bmc_sid: bytes = field(default_factory=lambda: os.urandom(4))
    console_sid: bytes = b""
    rm: bytes = b""
    rc: bytes = field(default_factory=lambda: os.urandom(16))
    ident: bytes = b""
    keys: SessionKeys | None = None
    #: Suites this BMC accepts; the one the console proposed is chosen, or refused (0x11).
    accept: tuple[int, ...] = (3,)
    suite: CipherSuite = SUITE_3

    def _mac(self, key: bytes, data: bytes) -> bytes:
        return _hmac(key, data, self.suite.digest)

    def on_open_request(self, p: bytes) -> bytes:
        if len(p) < 32:
            raise RmcpError("malformed open-session request")
        self.console_sid = p[4:8]
        proposed = next((SUITES[i] for i in self.accept if SUITES[i].records == p[8:32]), None)
        if proposed is None:  # table 13-15: 0x11, no matching cipher suite
            return bytes([p[0], 0x11, 0, 0]) + self.console_sid
        self.suite = proposed
        return bytes([p[0], 0, ROLE_ADMIN, 0]) + self.console_sid + self.bmc_sid + proposed.records

    def on_rakp1(self, p: bytes) -> bytes:
        if len(p) < 28 or p[4:8] != self.bmc_sid:
            raise RmcpError("malformed RAKP1")
        self.rm, role, name = p[8:24], p[24], p[28 : 28 + p[27]]
        password = self.users.get(name)
        if password is None:
            return bytes([p[0], 0x0D, 0, 0]) + self.console_sid
        self.ident = bytes([role, len(name)]) + name
        self._password = password
        code = self._mac(
            password, self.console_sid + self.bmc_sid + self.rm + self.rc + self.guid + self.ident
        )
        return bytes([p[0], 0, 0, 0]) + self.console_sid + self.rc + self.guid + code

    def on_rakp3(self, p: bytes) -> tuple[bytes, SessionKeys | None]:
        """RAKP4 to send, and the session keys if the console proved the password."""
        if len(p) < 28 or not self.ident:
            raise RmcpError("malformed RAKP3")
        expect = self._mac(self._password, self.rc + self.console_sid + self.ident)
        if not hmac.compare_digest(expect, p[8 : 8 + len(expect)]):
            return bytes([p[0], 0x0F, 0, 0]) + self.console_sid, None
        sik = self._mac(self._password, self.rm + self.rc + self.ident)
        self.keys = SessionKeys.from_sik(sik, self.suite)
        icv = self._mac(sik, self.rm + self.bmc_sid + self.guid)[: self.suite.icv_len]
        return bytes([p[0], 0, 0, 0]) + self.console_sid + icv, self.keys
