"""What must hold for any input to the TFTP core: one copy, driven by hypothesis
(test_tftp_fuzz.py) and by atheris (tftp_atheris.py), which only differ in how they choose
inputs. Each function raises AssertionError when an invariant breaks."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from metald.boot.tftp.admission import TransferTable
from metald.boot.tftp.packet import (
    MAX_BLKSIZE,
    MAX_TIMEOUT,
    MAX_WINDOW,
    MAX_WINDOW_BYTES,
    MIN_BLKSIZE,
    MalformedTftp,
    negotiate,
)
from metald.boot.tftp.transfer import MAX_RETRIES, ReadTransfer, Result

#: (kind, argument): ("ack", block), ("ack-near", offset from the acked block),
#: ("timeout", 0), ("rrq", 0), ("error", 0), ("garbage", bytes).
Event = tuple[str, int | bytes]


def file_bytes(size: int) -> bytes:
    """Content whose blocks differ (period 251, prime to every block size used)."""
    return (bytes(range(251)) * (size // 251 + 1))[:size]


def check_negotiation(options: dict[str, str], size: int) -> None:
    n = negotiate(options, size)
    assert MIN_BLKSIZE <= n.blksize <= MAX_BLKSIZE or n.blksize == 512
    assert 1 <= n.windowsize <= MAX_WINDOW
    assert n.windowsize == 1 or n.blksize * n.windowsize <= MAX_WINDOW_BYTES
    assert 0 < n.timeout <= MAX_TIMEOUT
    oack = n.oack or {}
    assert set(oack) <= set(options)
    if "blksize" in oack:
        assert oack["blksize"] == str(n.blksize)
    else:
        assert n.blksize == 512
    if "windowsize" in oack:
        assert oack["windowsize"] == str(n.windowsize)
    else:
        assert n.windowsize == 1
    if "timeout" in oack:  # RFC 2349: echoed exactly, or not at all
        assert oack["timeout"] == options["timeout"] and float(oack["timeout"]) == n.timeout
    if "tsize" in oack:
        assert oack["tsize"] == str(size)


def _data_blocks(pkts: list[bytes]) -> list[tuple[int, bytes]]:
    return [(struct.unpack("!H", p[2:4])[0], p[4:]) for p in pkts if p[:2] == b"\0\3"]


@dataclass
class Drive:
    transfer: ReadTransfer
    #: Blocks resent because of ACKs, and DATA packets sent in all.
    ack_resends: int
    total_data: int
    budget: int


def drive_transfer(size: int, options: dict[str, str], events: list[Event]) -> Drive:
    """Run a transfer of a ``size``-byte file (under 65536 blocks: no rollover) against an
    adversarial client and check, after every event: blocks only inside the window and with
    the right bytes; an ACK sends blocks never sent only as far as it acknowledged (plus the
    first window when it confirms); timeouts and repeated requests only resend; silence ends
    the transfer within its retry limit; nothing after the end. Over the whole run: everything
    resent came out of the budget, and ACKs alone never resent more than the file once."""
    data = file_bytes(size)
    t = ReadTransfer(data, negotiate(options, size))
    w = t.window
    budget0 = t.budget
    assert budget0 <= 4 * t.nblocks + 4 * w
    first = _data_blocks(t.start())
    assert len(first) <= 1
    total_data = len(first)
    ack_resends = 0
    quiet = 0  # timeouts since the last progress
    for kind, arg in events:
        was_done, acked0, sent0, confirmed0 = t.done, t.acked, t.sent, t.confirmed
        if kind in ("ack", "ack-near"):
            assert isinstance(arg, int)
            n = arg if kind == "ack" else (t.acked + arg) & 0xFFFF
            out = t.on_packet(struct.pack("!HH", 4, n & 0xFFFF))
        elif kind == "timeout":
            out = t.on_timeout()
        elif kind == "rrq":
            out = t.on_repeated_request()
        elif kind == "error":
            out = t.on_packet(b"\0\5\0\0bye\0")
            assert t.result is Result.CLIENT_ERROR or was_done
        else:
            assert isinstance(arg, bytes)
            try:
                out = t.on_packet(arg)
            except MalformedTftp:
                out = []
        if was_done:
            assert out == []
            continue
        blocks = _data_blocks(out)
        total_data += len(blocks)
        for n, payload in blocks:
            assert t.acked < n <= t.acked + w and n <= t.nblocks
            assert payload == data[(n - 1) * t.blksize : n * t.blksize]
        new = [n for n, _ in blocks if n > sent0]
        if kind in ("ack", "ack-near"):
            ack_resends += len(blocks) - len(new)
            assert len(new) <= (t.acked - acked0) + (w if not confirmed0 else 0)
            assert t.sent >= sent0
        else:
            assert not new and len(blocks) <= w
        if t.acked > acked0 or (t.confirmed and not confirmed0):
            quiet = 0
        elif kind == "timeout":
            quiet += 1
            if t.confirmed:
                assert quiet <= MAX_RETRIES or t.done
            else:
                assert quiet < t.unconfirmed_timeouts or t.done
                assert not out  # nothing is sent to an unverified address on a timer
    assert total_data <= t.nblocks + budget0
    assert ack_resends <= t.nblocks
    return Drive(t, ack_resends, total_data, budget0)


#: (op, argument): ("admit", address index), ("confirm", i), ("remove", i), ("tick", seconds).
AdmissionOp = tuple[str, int]


def run_admission(
    ops: list[AdmissionOp], max_total: int = 6, max_per_client: int = 3, stale_after: int = 30
) -> None:
    """Drive a TransferTable beside a plain model and check: caps never exceeded; a confirmed
    transfer evicted only when it is stale and no unconfirmed one is in its scope; a refusal
    only when every transfer in its scope is confirmed and fresh."""
    table: TransferTable[int] = TransferTable(max_total, max_per_client, stale_after)
    addr: dict[int, str] = {}
    since: dict[int, int] = {}
    confirmed: set[int] = set()
    addrs = ["a", "b", "c", "d"]
    now = 0

    def fresh_and_confirmed(keys: list[int]) -> bool:
        return all(k in confirmed and now - since[k] < stale_after for k in keys)

    for key, (op, i) in enumerate(ops):
        if op == "tick":
            now += i % 40
        elif op == "admit":
            a = addrs[i % len(addrs)]
            mine = [k for k, x in addr.items() if x == a]
            everyone = list(addr)
            adm = table.admit(key, a, now)
            for k, why in adm.evicted:
                if why == "evicted-unconfirmed":
                    assert k not in confirmed, "a confirmed transfer was evicted as unconfirmed"
                else:
                    assert why == "evicted-stale" and now - since[k] >= stale_after
                    scope = mine if addr[k] == a and len(mine) >= max_per_client else everyone
                    assert all(x in confirmed for x in scope), "stale evicted before unconfirmed"
                del addr[k]
            if adm.admitted:
                addr[key] = a
                since[key] = now
            elif adm.reason == "refused-per-client":
                assert len(mine) == max_per_client and fresh_and_confirmed(mine)
            else:
                assert adm.reason == "busy" and len(addr) == max_total
                assert fresh_and_confirmed(list(addr))
        elif addr:
            k = sorted(addr)[i % len(addr)]
            if op == "confirm":
                table.confirm(k)
                confirmed.add(k)
            else:
                table.remove(k)
                del addr[k]
                confirmed.discard(k)
        assert len(table) == len(addr) <= max_total
        for a in addrs:
            assert table.count(a) == sum(1 for x in addr.values() if x == a) <= max_per_client
        assert table.unconfirmed == len(set(addr) - confirmed)
