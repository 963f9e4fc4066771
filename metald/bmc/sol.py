"""IPMI Serial-over-LAN (payload type 1) as a pure core: bytes and clock readings in, bytes
out, no sockets. The asyncio shell that carries it over an RMCP+ session is
``metald.bmc.sol_link``; section numbers refer to the IPMI v2.0 rev 1.1 specification.

SOL is stop-and-wait in each direction (section 15.9): a data packet carries a 4-bit sequence
number (1-15; 0 means "no data, only an acknowledgement"), the receiver answers with that
number, how many characters it accepted, and a NACK bit when it took none. The sender keeps one
packet in flight, re-sends it after ``retransmit_s`` with the same number, and resumes with the
characters the peer did not accept under the next number. A packet seen twice (its ack lost) is
acknowledged again but its characters are delivered once.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field

PAYLOAD_SOL = 0x01

#: Activate / Deactivate Payload (section 24.1, 24.2), NetFn App.
CMD_ACTIVATE_PAYLOAD = 0x48
CMD_DEACTIVATE_PAYLOAD = 0x49
#: Activate Payload completion codes (table 24-2).
ACTIVATE_ERRORS = {
    0x80: "SOL is already active on another session",
    0x81: "SOL is disabled on this BMC",
    0x82: "the BMC's SOL session limit is reached",
    0x83: "the BMC refuses SOL with encryption",
    0x84: "the BMC refuses SOL without encryption",
}
ALREADY_ACTIVE = 0x80

# Operation bits, console to BMC (table 15-2).
OP_NACK = 0x40
OP_BREAK = 0x10
# Status bits, BMC to console (table 15-2).
ST_NACK = 0x40
ST_UNAVAILABLE = 0x20  # character transfer unavailable (the BMC cannot take data now)
ST_DEACTIVATING = 0x10
ST_OVERRUN = 0x08
ST_BREAK = 0x04

#: Characters per outbound packet when the BMC names no size (pyghmi and ipmitool use ~200).
DEFAULT_CHUNK = 200


class SolError(Exception):
    """A SOL payload that cannot be used (too short)."""


@dataclass(frozen=True)
class SolPacket:
    seq: int
    ack: int
    accepted: int
    status: int
    data: bytes = b""


def encode_sol(p: SolPacket) -> bytes:
    return bytes([p.seq & 0x0F, p.ack & 0x0F, p.accepted & 0xFF, p.status & 0xFF]) + p.data


def decode_sol(payload: bytes) -> SolPacket:
    if len(payload) < 4:
        raise SolError(f"SOL payload of {len(payload)} bytes (at least 4)")
    return SolPacket(payload[0] & 0x0F, payload[1] & 0x0F, payload[2], payload[3], payload[4:])


def activate_request(*, encrypt: bool = True, instance: int = 1) -> bytes:
    """Activate Payload data: SOL, instance, aux byte 1 = encryption + authentication (the
    session's own), serial alerts deferred while SOL runs, no startup handshake."""
    aux = (0x80 | 0x40) if encrypt else 0x00
    return bytes([PAYLOAD_SOL, instance, aux | 0x02, 0, 0, 0])


def deactivate_request(instance: int = 1) -> bytes:
    return bytes([PAYLOAD_SOL, instance, 0, 0, 0, 0])


@dataclass(frozen=True)
class Activation:
    inbound_size: int  # the largest payload the BMC takes from us
    outbound_size: int
    port: int


def parse_activation(data: bytes) -> Activation:
    """The Activate Payload response data (after the completion code)."""
    if len(data) < 10:
        raise SolError(f"Activate Payload answer of {len(data)} bytes (at least 10)")
    inbound, outbound, port = struct.unpack_from("<HHH", data, 4)
    return Activation(inbound, outbound, port)


@dataclass
class SolCounters:
    sent: int = 0
    retransmitted: int = 0
    received: int = 0
    duplicates: int = 0
    malformed: int = 0
    stale_acks: int = 0


@dataclass
class SolCore:
    """One SOL conversation's state. ``write``/``send_break`` queue what the console types;
    ``on_payload`` takes a payload from the BMC and returns the characters it carried (each
    once); ``due(now)`` returns the payloads to send now; ``next_deadline`` says when to ask
    again. ``failed`` is set when a packet went unacknowledged ``max_tries`` times, and
    ``deactivated`` when the BMC said SOL is ending: either way the shell should reconnect."""

    retransmit_s: float = 1.0
    max_tries: int = 5
    #: The BMC's end (a simulator): the peer's status bits are the console's operations.
    bmc_side: bool = False
    chunk: int = DEFAULT_CHUNK
    counters: SolCounters = field(default_factory=SolCounters)
    _outq: deque[bytes] = field(default_factory=deque)
    _break: bool = False
    _next_seq: int = 1
    _inflight: SolPacket | None = None
    _sent_at: float = 0.0
    _tries: int = 0
    _last_rx_seq: int = 0
    _last_rx_len: int = 0
    _ack_pending: bool = False
    failed: bool = False
    deactivated: bool = False
    #: The BMC reported a break on the host's serial line; on the BMC's end, the console
    #: asked for one (the shell clears it once it has sent the break).
    break_seen: bool = False

    def write(self, data: bytes) -> None:
        if data:
            self._outq.append(bytes(data))

    def send_break(self) -> None:
        self._break = True

    @property
    def pending(self) -> int:
        """Characters queued or in flight."""
        inflight = len(self._inflight.data) if self._inflight else 0
        return inflight + sum(len(b) for b in self._outq)

    def on_payload(self, payload: bytes, now: float) -> bytes:
        try:
            p = decode_sol(payload)
        except SolError:
            self.counters.malformed += 1
            return b""
        if self.bmc_side:
            if p.status & OP_BREAK:
                self.break_seen = True
        else:
            if p.status & ST_DEACTIVATING:
                self.deactivated = True
            if p.status & ST_BREAK:
                self.break_seen = True
        self._on_ack(p, now)
        if p.seq == 0:
            return b""
        self._ack_pending = True  # a numbered packet is acknowledged, data or not (a break)
        if p.seq == self._last_rx_seq:
            # Our ack was lost and the BMC re-sent: acknowledge again, deliver nothing.
            self.counters.duplicates += 1
            self._last_rx_len = len(p.data)
            return b""
        self._last_rx_seq, self._last_rx_len = p.seq, len(p.data)
        self.counters.received += len(p.data)
        return p.data

    def _on_ack(self, p: SolPacket, now: float) -> None:
        f = self._inflight
        if f is None or p.ack == 0:
            return
        if p.ack != f.seq:
            self.counters.stale_acks += 1
            return
        if p.status & (ST_NACK | ST_UNAVAILABLE):
            # Refused for now: leave it in flight, re-sent on the timer (not a failure try).
            self._tries = max(0, self._tries - 1)
            return
        taken = min(p.accepted, len(f.data))
        rest = f.data[taken:]
        if rest:
            self._outq.appendleft(rest)
        self._inflight = None
        self._tries = 0

    def due(self, now: float) -> list[bytes]:
        out: list[bytes] = []
        ack, accepted = self._ack_fields()
        f = self._inflight
        if f is not None:
            if now - self._sent_at >= self.retransmit_s:
                if self._tries >= self.max_tries:
                    self.failed = True
                    return out
                self._tries += 1
                self._sent_at = now
                self.counters.retransmitted += 1
                out.append(encode_sol(SolPacket(f.seq, ack, accepted, f.status, f.data)))
                self._ack_pending = False
            elif self._ack_pending:
                out.append(encode_sol(SolPacket(0, ack, accepted, 0)))
                self._ack_pending = False
            return out
        if self._outq or self._break:
            data = self._take(self.chunk)
            status = OP_BREAK if self._break else 0
            self._break = False
            f = self._inflight = SolPacket(self._next_seq, 0, 0, status, data)
            self._next_seq = self._next_seq % 15 + 1
            self._sent_at, self._tries = now, 1
            self.counters.sent += len(data)
            out.append(encode_sol(SolPacket(f.seq, ack, accepted, status, data)))
            self._ack_pending = False
        elif self._ack_pending:
            out.append(encode_sol(SolPacket(0, ack, accepted, 0)))
            self._ack_pending = False
        return out

    def _ack_fields(self) -> tuple[int, int]:
        if not self._ack_pending:
            return 0, 0
        return self._last_rx_seq, self._last_rx_len

    def _take(self, n: int) -> bytes:
        buf = bytearray()
        while self._outq and len(buf) < n:
            head = self._outq.popleft()
            room = n - len(buf)
            buf += head[:room]
            if len(head) > room:
                self._outq.appendleft(head[room:])
        return bytes(buf)

    def next_deadline(self) -> float | None:
        """When ``due`` has something to do without new input (a retransmission); None when
        only new input (a write, a payload) can make work."""
        if self._inflight is not None:
            return self._sent_at + self.retransmit_s
        return None
