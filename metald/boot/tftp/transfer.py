"""One read transfer as a pure state machine: packets in, packets out, timeouts as events.

Blocks are counted from 1 without limit and sent modulo 65536 (block-number rollover, which
files over 32 MB at 512-byte blocks need). With a window (RFC 7440) up to ``windowsize`` blocks
go out per ACK; an ACK for any block in the window moves it forward from there.
"""

from __future__ import annotations

from enum import StrEnum

from metald.boot.tftp.packet import (
    MalformedTftp,
    Negotiated,
    Opcode,
    data_packet,
    oack_packet,
    parse_ack_or_error,
)

#: Retransmissions of one window before the transfer is given up.
MAX_RETRIES = 5


class Result(StrEnum):
    RUNNING = "running"
    OK = "ok"
    TIMEOUT = "timeout"
    CLIENT_ERROR = "client-error"  # the client sent ERROR (e.g. it only wanted tsize)


class ReadTransfer:
    def __init__(self, data: bytes, neg: Negotiated, *, name: str = "") -> None:
        self.name = name
        self.data = data
        self.neg = neg
        self.blksize = neg.blksize
        #: The last block is shorter than blksize (empty when the size is a multiple).
        self.nblocks = len(data) // self.blksize + 1
        self.acked = 0  # highest block the client acknowledged; 0 = OACK (or nothing) acked
        self.sent = 0  # highest block sent
        self.oack_pending = neg.oack is not None
        self.retries = 0
        self.result = Result.RUNNING
        self.error_message = ""

    @property
    def done(self) -> bool:
        return self.result is not Result.RUNNING

    def start(self) -> list[bytes]:
        if self.oack_pending:
            assert self.neg.oack is not None
            return [oack_packet(self.neg.oack)]
        return self._window()

    def _block(self, n: int) -> bytes:
        off = (n - 1) * self.blksize
        return data_packet(n, self.data[off : off + self.blksize])

    def _window(self) -> list[bytes]:
        last = min(self.acked + self.neg.windowsize, self.nblocks)
        self.sent = last
        return [self._block(n) for n in range(self.acked + 1, last + 1)]

    def on_packet(self, data: bytes) -> list[bytes]:
        """A packet from the client's TID. Raises MalformedTftp for garbage."""
        if self.done:
            return []
        op, n, msg = parse_ack_or_error(data)
        if op is Opcode.ERROR:
            self.result, self.error_message = Result.CLIENT_ERROR, msg
            return []
        if self.oack_pending:
            if n != 0:
                return []
            self.oack_pending = False
            self.retries = 0
            return self._window()
        # Map the 16-bit block number onto the window in flight [acked, sent].
        base = self.acked
        k = base + ((n - base) & 0xFFFF)
        if k > self.sent:
            return []  # an old duplicate ACK from before a rollover; ignore
        if k == base:
            # Duplicate ACK of what we already know: do not resend (sorcerer's apprentice).
            return []
        self.acked = k
        self.retries = 0
        if self.acked >= self.nblocks:
            self.result = Result.OK
            return []
        if self.acked == self.sent:
            return self._window()
        # Partial window acknowledged: restart the window from there (RFC 7440).
        return self._window()

    def on_timeout(self) -> list[bytes]:
        if self.done:
            return []
        self.retries += 1
        if self.retries > MAX_RETRIES:
            self.result = Result.TIMEOUT
            return []
        if self.oack_pending:
            assert self.neg.oack is not None
            return [oack_packet(self.neg.oack)]
        return self._window()


__all__ = ["MalformedTftp", "ReadTransfer", "Result"]
