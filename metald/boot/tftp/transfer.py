"""One read transfer as a pure state machine: packets in, packets out, timeouts as events.

Blocks are counted from 1 without limit and sent modulo 65536 (block-number rollover, which
files over 32 MB at 512-byte blocks need). With a window (RFC 7440) up to ``windowsize`` blocks
are in flight; an ACK for block k sends k+1..k+windowsize. Blocks among those already sent
(a partial ACK: the client lost k+1) and every resend on a timeout are paid from one budget per
transfer (four times the file plus a few windows): past it, an ACK sends only blocks never sent, so
a client acknowledging one block at a time cannot make the server send the file windowsize
times over. A window is restarted by a partial ACK at most once until an ACK passes its end,
and a duplicate ACK sends nothing (sorcerer's apprentice).

A transfer is *unconfirmed* until its first valid ACK: until then nothing proves the request
came from its source address (UDP is spoofable). So the server sends to that address only in
answer to a packet from it (the first packet per request, resent only when the request is
repeated, at most ``UNCONFIRMED_RETRIES`` times), never on its own timer: a forged request
gets one packet back, not a stream. It waits about ``UNCONFIRMED_LIFE`` seconds for the
client's ACK (long enough for EDK2, which repeats a lost packet after 4 s) and may be evicted
before that to make room (see ``admission``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from enum import StrEnum

from metald.boot.tftp.packet import (
    ErrorCode,
    MalformedTftp,
    Negotiated,
    Opcode,
    data_packet,
    error_packet,
    oack_packet,
    parse_ack_or_error,
)
from metald.boot.tftp.source import BytesSource, Source

#: Consecutive timeouts without progress before a confirmed transfer is given up.
MAX_RETRIES = 5
#: Resends of the first packet (OACK or block 1) on a repeated request while no ACK has come.
UNCONFIRMED_RETRIES = 2
#: Seconds an unconfirmed transfer waits for its first ACK: whole timeouts, at least three, so
#: at most 15 s with ``MAX_TIMEOUT``.
UNCONFIRMED_LIFE = 12.0
#: Blocks resent over a whole transfer, at most: the file ``RESEND_FILES`` times more plus a
#: few windows (10 % random loss at windowsize 16 needs about 2.5 times). It bounds what a
#: client that makes a little progress before each give-up point can make the server send.
RESEND_FILES = 4
RESEND_WINDOWS = 4


#: Files at most this big get their DATA packets built once per block size and shared by
#: every transfer of that file (200 clients fetching ipxe.efi send the same bytes objects);
#: the cache holds at most ``PACKETS_TOTAL_MAX`` bytes of packets, least recently used out.
#: Built on a transfer's first ACK, not on its request, so forged requests (one packet back
#: each) cannot make the server build packet lists for block sizes nobody fetches.
PACKETS_FILE_MAX = 4 << 20
PACKETS_TOTAL_MAX = 32 << 20


class PacketCache:
    """(file contents, blksize) -> the file's DATA packets, block 1 first. Bounded, LRU."""

    def __init__(self, total_max: int = PACKETS_TOTAL_MAX) -> None:
        self.total_max = total_max
        self.total = 0
        #: Keyed by the contents' id; the entry holds the contents, so the id stays theirs.
        self._lists: OrderedDict[tuple[int, int], tuple[bytes, list[bytes], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lists)

    @staticmethod
    def cost(size: int, blksize: int) -> int:
        """Bytes an entry holds at most: the packets (a copy of the file plus a header and
        a bytes object's overhead per block) and the contents themselves, which the entry
        keeps alive even after the file cache has dropped them."""
        return 2 * size + 64 * (size // blksize + 1)

    def get(self, data: bytes, blksize: int) -> list[bytes] | None:
        if len(data) > PACKETS_FILE_MAX:
            return None
        key = (id(data), blksize)
        hit = self._lists.get(key)
        if hit is not None and hit[0] is data:
            self._lists.move_to_end(key)
            return hit[1]
        nblocks = len(data) // blksize + 1
        cost = self.cost(len(data), blksize)
        if cost > self.total_max:
            return None
        packets = [
            data_packet(n, data[(n - 1) * blksize : n * blksize]) for n in range(1, nblocks + 1)
        ]
        while self._lists and self.total + cost > self.total_max:
            _, (_, _, old) = self._lists.popitem(last=False)
            self.total -= old
        self._lists[key] = (data, packets, cost)
        self.total += cost
        return packets


#: The process's packet lists (TFTP serves from one event loop).
PACKETS = PacketCache()


class Result(StrEnum):
    RUNNING = "running"
    OK = "ok"
    TIMEOUT = "timeout"
    CLIENT_ERROR = "client-error"  # the client sent ERROR (e.g. it only wanted tsize)
    FILE_CHANGED = "file-changed"  # the file shrank under a transfer read by pread


#: Looked up once per ACK: a module global is several times cheaper than an enum attribute.
RUNNING = Result.RUNNING
_ACK = int(Opcode.ACK)


class ReadTransfer:
    def __init__(
        self,
        source: Source | bytes,
        neg: Negotiated,
        *,
        name: str = "",
        packets: PacketCache | None = PACKETS,
    ) -> None:
        self.name = name
        self.source: Source = BytesSource(source) if isinstance(source, bytes) else source
        self.size = self.source.size
        self.neg = neg
        self.blksize = neg.blksize
        self.window = neg.windowsize
        #: The last block is shorter than blksize (empty when the size is a multiple).
        self.nblocks = self.size // self.blksize + 1
        self.acked = 0  # highest block the client acknowledged; 0 = OACK (or nothing) acked
        self.sent = 0  # highest block sent
        self.recover = 0  # blocks up to here were resent since the last ACK beyond them
        self.oack_pending = neg.oack is not None
        #: A valid ACK came from the client's address and port: it really asked.
        self.confirmed = False
        self.retries = 0  # timeouts since the last progress
        self.repeats = 0  # repeated requests answered while unconfirmed
        #: Timeouts an unconfirmed transfer waits for its first ACK.
        self.unconfirmed_timeouts = max(3, math.ceil(UNCONFIRMED_LIFE / neg.timeout))
        #: Blocks (or first packets) that may still be resent.
        self.budget = RESEND_FILES * self.nblocks + RESEND_WINDOWS * self.window
        self._data = self.source.data if isinstance(self.source, BytesSource) else None
        self._packet_cache = packets
        #: The file's DATA packets (shared), once the client has confirmed; else None.
        self._packets: list[bytes] | None = None
        self.result = Result.RUNNING
        self.error_message = ""

    @property
    def done(self) -> bool:
        return self.result is not RUNNING

    @property
    def interval(self) -> float:
        """Seconds of silence before a retransmission (the negotiated timeout)."""
        return self.neg.timeout

    def start(self) -> list[bytes]:
        if self.oack_pending:
            assert self.neg.oack is not None
            return [oack_packet(self.neg.oack)]
        return self._send_upto(1)

    def _block(self, n: int) -> bytes | None:
        if self._packets is not None:
            return self._packets[n - 1]
        off = (n - 1) * self.blksize
        if self._data is not None:  # the common case, without a call per block
            return data_packet(n, self._data[off : off + self.blksize])
        want = min(self.blksize, self.size - off)
        payload = self.source.read(off, want)
        if len(payload) != want:
            return None
        return data_packet(n, payload)

    def _send_range(self, first: int, last: int) -> list[bytes]:
        out = []
        for n in range(first, last + 1):
            p = self._block(n)
            if p is None:
                self.result = Result.FILE_CHANGED
                return [error_packet(ErrorCode.UNDEFINED, "file changed during transfer")]
            out.append(p)
        return out

    def _send_upto(self, last: int) -> list[bytes]:
        """Blocks sent+1..last (those never sent), and remember them as sent."""
        last = min(last, self.nblocks)
        first = self.sent + 1
        if last < first:
            return []
        self.sent = last
        if self._packets is not None:  # the hot path: a slice of the shared packets
            return self._packets[first - 1 : last]
        data = self._data
        if data is not None:  # the hot path, one call per ACK: no per-block calls
            bs = self.blksize
            return [data_packet(n, data[(n - 1) * bs : n * bs]) for n in range(first, last + 1)]
        return self._send_range(first, last)

    def on_packet(self, data: bytes) -> list[bytes]:
        """A packet from the client's TID. Raises MalformedTftp for garbage."""
        if self.result is not RUNNING:
            return []
        if len(data) >= 4 and data[1] == _ACK and data[0] == 0:  # the common case
            n = data[2] << 8 | data[3]
            packets = self._packets
            if packets is not None:
                # The hot path, once per block in lock-step: confirmed, shared packets, and
                # the ACK covers everything sent (what ``_on_ack`` does for it, inline).
                k = self.acked + ((n - self.acked) & 0xFFFF)
                if k == self.sent and k != self.acked and k < self.nblocks:
                    self.acked = k
                    self.retries = 0
                    last = k + self.window
                    if last > self.nblocks:
                        last = self.nblocks
                    self.sent = last
                    return packets[k:last]
                return self._on_ack(n)
        else:
            op, n, msg = parse_ack_or_error(data)
            if op is Opcode.ERROR:
                self.result, self.error_message = Result.CLIENT_ERROR, msg
                return []
        if self.confirmed:
            return self._on_ack(n)
        out = self._on_ack(n)
        if self.confirmed and self._data is not None and self._packet_cache is not None:
            # The first valid ACK: the client really asked. Share (or build) the file's
            # packets for the rest of the transfer.
            self._packets = self._packet_cache.get(self._data, self.blksize)
        return out

    def lockstep_packets(self) -> list[bytes] | None:
        """The shared DATA packets while the C drain (server.py) may answer ACKs in this
        transfer's place: running, windowsize 1, confirmed with shared packets. It does only
        what ``on_packet``'s inline path does, then reports back with ``lockstep_advanced``."""
        if self.window == 1 and self.result is RUNNING:
            return self._packets
        return None

    def lockstep_advanced(self, acked: int, sent: int) -> None:
        """The C drain answered in-order ACKs up to block ``acked`` (``on_packet``'s inline
        path, in C): the same state change as that path."""
        self.acked = acked
        self.sent = sent
        self.retries = 0

    def _on_ack(self, n: int) -> list[bytes]:
        if self.oack_pending:
            if n != 0:
                return []
            self.oack_pending = False
            self.confirmed = True
            self.retries = 0
            return self._send_upto(self.window)
        # Map the 16-bit block number onto the window in flight [acked, sent].
        base = self.acked
        k = base + ((n - base) & 0xFFFF)
        if k > self.sent or k == base:
            # A block never sent (or from before a rollover), or a duplicate ACK: nothing to
            # send (resending on duplicates is the sorcerer's apprentice; timeouts resend).
            return []
        self.acked = k
        self.confirmed = True
        self.retries = 0
        if self.acked >= self.nblocks:
            self.result = Result.OK
            return []
        lost = self.sent - k
        if lost > 0 and k >= self.recover and self.budget >= lost:
            # A partial ACK: the client lost block k+1 and dropped what followed (RFC 7440);
            # restart the window there. Once per window (blocks up to ``recover`` were just
            # resent), and paid from the budget, so ACKs cannot amplify.
            self.budget -= lost
            self.recover = self.sent
            out = self._send_range(k + 1, self.sent)
            if self.done:
                return out
            return out + self._send_upto(k + self.window)
        return self._send_upto(k + self.window)

    def on_timeout(self) -> list[bytes]:
        """The negotiated timeout passed with no progress: resend what is unacknowledged
        (nothing while unconfirmed: the client repeats its request if it is real)."""
        if self.done:
            return []
        self.retries += 1
        if not self.confirmed:
            if self.retries >= self.unconfirmed_timeouts:
                self.result = Result.TIMEOUT
            return []
        if self.retries > MAX_RETRIES or self.budget < self._resend_cost():
            self.result = Result.TIMEOUT
            return []
        return self._resend()

    def on_repeated_request(self) -> list[bytes]:
        """The client sent its RRQ again (our first packet was lost): resend it, out of the
        same retransmission budget as a timeout, so repeated RRQs cannot amplify."""
        if self.done or self.confirmed:
            return []
        self.repeats += 1
        if self.repeats > UNCONFIRMED_RETRIES or self.budget < self._resend_cost():
            return []
        return self._resend()

    def _resend_cost(self) -> int:
        return 1 if self.oack_pending else max(1, self.sent - self.acked)

    def _resend(self) -> list[bytes]:
        self.budget -= self._resend_cost()
        self.recover = self.sent
        if self.oack_pending:
            assert self.neg.oack is not None
            return [oack_packet(self.neg.oack)]
        return self._send_range(self.acked + 1, self.sent)

    def close(self) -> None:
        self.source.close()


__all__ = ["RUNNING", "MalformedTftp", "ReadTransfer", "Result"]
