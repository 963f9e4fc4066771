"""A small WebSocket client (RFC 6455) on the standard library, for ``metalctl machines
console``: metalctl stays an HTTP client without aiohttp (import-linter's contract).

The framing is a pure core (``encode_frame``, ``FrameReader``: bytes in, messages out); the
shell is one blocking socket that the caller multiplexes with ``select`` (``fileno``,
``pending``)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import socket
import ssl
import struct
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
#: A message larger than this from the server is a protocol error (the console sends chunks).
MAX_MESSAGE = 1 << 20


class WsError(Exception):
    """The server broke the WebSocket protocol, or the connection ended."""


class WsRefused(WsError):
    """The server answered the upgrade with an HTTP error (``problem`` is its body)."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        super().__init__(f"HTTP {status}: {problem.get('detail') or problem.get('title') or ''}")
        self.status = status
        self.problem = problem


def encode_frame(opcode: int, payload: bytes, mask: bytes | None = None) -> bytes:
    """One final frame; a client masks every frame (RFC 6455 5.3)."""
    mask = os.urandom(4) if mask is None else mask
    n = len(payload)
    head = bytes([0x80 | opcode])
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 1 << 16:
        head += bytes([0x80 | 126]) + struct.pack(">H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack(">Q", n)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return head + mask + masked


@dataclass
class Message:
    opcode: int
    data: bytes


class FrameReader:
    """Server frames (unmasked) to whole messages; control frames pass through at once."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._parts: list[bytes] = []
        self._opcode = 0

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out: list[Message] = []
        while True:
            frame = self._frame()
            if frame is None:
                return out
            fin, opcode, payload = frame
            if opcode >= 0x8:
                out.append(Message(opcode, payload))
                continue
            if opcode != OP_CONT:
                self._opcode, self._parts = opcode, []
            self._parts.append(payload)
            if sum(len(p) for p in self._parts) > MAX_MESSAGE:
                raise WsError("the server sent a message over 1 MiB")
            if fin:
                out.append(Message(self._opcode, b"".join(self._parts)))
                self._parts = []

    def _frame(self) -> tuple[bool, int, bytes] | None:
        b = self._buf
        if len(b) < 2:
            return None
        fin, opcode, masked, n = b[0] & 0x80, b[0] & 0x0F, b[1] & 0x80, b[1] & 0x7F
        at = 2
        if n == 126:
            if len(b) < 4:
                return None
            n, at = struct.unpack_from(">H", b, 2)[0], 4
        elif n == 127:
            if len(b) < 10:
                return None
            n, at = struct.unpack_from(">Q", b, 2)[0], 10
        if n > MAX_MESSAGE:
            raise WsError("the server sent a frame over 1 MiB")
        key = b""
        if masked:
            if len(b) < at + 4:
                return None
            key, at = bytes(b[at : at + 4]), at + 4
        if len(b) < at + n:
            return None
        payload = bytes(b[at : at + n])
        if key:
            payload = bytes(x ^ key[i % 4] for i, x in enumerate(payload))
        del b[: at + n]
        return bool(fin), opcode, payload


class WebSocket:
    def __init__(self, sock: socket.socket, leftover: bytes) -> None:
        self.sock = sock
        self.reader = FrameReader()
        self._early = self.reader.feed(leftover) if leftover else []
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def pending(self) -> bool:
        """Decrypted bytes waiting inside an SSL socket (select does not see them)."""
        return bool(self._early) or (
            isinstance(self.sock, ssl.SSLSocket) and self.sock.pending() > 0
        )

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(encode_frame(OP_BINARY, data))

    def send_json(self, obj: Any) -> None:
        self.sock.sendall(encode_frame(OP_TEXT, json.dumps(obj).encode()))

    def receive(self) -> list[Message]:
        """What one read brings (call when the socket is readable); pings are answered, a
        close is answered and returned; an ended connection returns a close."""
        if self._early:
            out, self._early = self._early, []
            return out
        data = self.sock.recv(65536)
        if not data:
            self.closed = True
            return [Message(OP_CLOSE, b"")]
        out = []
        for m in self.reader.feed(data):
            if m.opcode == OP_PING:
                self.sock.sendall(encode_frame(OP_PONG, m.data))
            elif m.opcode == OP_CLOSE:
                self.close(m.data[:2] or b"\x03\xe8")
                out.append(m)
            elif m.opcode != OP_PONG:
                out.append(m)
        return out

    def close(self, code: bytes = b"\x03\xe8") -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.sendall(encode_frame(OP_CLOSE, code))
        self.sock.close()


def connect(url: str, headers: dict[str, str], timeout: float = 30.0) -> WebSocket:
    """Open a WebSocket to an http(s) or ws(s) URL; WsRefused with the problem on an HTTP
    error, WsError if the server does not speak WebSocket."""
    u = urlsplit(url)
    secure = u.scheme in ("https", "wss")
    host = u.hostname or "localhost"
    port = u.port or (443 if secure else 80)
    sock: socket.socket = socket.create_connection((host, port), timeout=timeout)
    if secure:
        sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
    key = base64.b64encode(os.urandom(16)).decode()
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    lines = [
        f"GET {path} HTTP/1.1",
        f"Host: {u.netloc}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(4096)
        if not chunk:
            raise WsError("the server closed the connection during the upgrade")
        buf += chunk
        if len(buf) > 65536:
            raise WsError("the server's answer head is too large")
    head, rest = buf.split(b"\r\n\r\n", 1)
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split()[1])
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    if status != 101:
        length = int(hdrs.get("content-length", "0") or 0)
        while len(rest) < min(length, 65536):
            chunk = sock.recv(4096)
            if not chunk:
                break
            rest += chunk
        sock.close()
        try:
            problem = json.loads(rest or b"{}")
        except ValueError:
            problem = {}
        raise WsRefused(status, problem if isinstance(problem, dict) else {})
    accept = base64.b64encode(hashlib.sha1(key.encode() + GUID).digest()).decode()
    if hdrs.get("sec-websocket-accept") != accept:
        sock.close()
        raise WsError("the server's upgrade answer does not prove it read our key")
    sock.settimeout(None)
    return WebSocket(sock, rest)
