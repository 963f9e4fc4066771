"""The TFTP hot path's shortcuts give the slow path's answers: shared precomputed DATA packets
(bounded, built only for confirmed transfers) and the inline ACK parse."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from metald.boot.tftp.packet import MalformedTftp, data_packet, negotiate
from metald.boot.tftp.transfer import PACKETS_FILE_MAX, PacketCache, ReadTransfer

events = st.lists(
    st.one_of(
        st.integers(0, 0xFFFF).map(lambda n: ("packet", struct.pack("!HH", 4, n))),
        st.tuples(st.integers(0, 0xFFFF), st.binary(max_size=6)).map(
            lambda t: ("packet", struct.pack("!HH", 5, t[0]) + t[1] + b"\x00")
        ),
        st.binary(max_size=8).map(lambda b: ("packet", b)),  # garbage, truncated ACKs
        st.just(("timeout", b"")),
        st.just(("repeat", b"")),
        # ACKs near the window in flight (``sent`` plus -3..1, taken when the step runs):
        # in-order ACKs (the inline lock-step path), partial ACKs, duplicates, one too far.
        st.integers(-3, 1).map(lambda d: ("ack-sent", struct.pack("!h", d))),
        st.just(("ack-sent", struct.pack("!h", 0))),
    ),
    max_size=60,
)


def _step(m: ReadTransfer, kind: str, raw: bytes) -> object:
    try:
        if kind == "timeout":
            return m.on_timeout()
        if kind == "repeat":
            return m.on_repeated_request()
        if kind == "ack-sent":
            n = m.sent + struct.unpack("!h", raw)[0]
            return m.on_packet(struct.pack("!HH", 4, n & 0xFFFF))
        return m.on_packet(raw)
    except MalformedTftp as e:
        return ("malformed", e.reason)


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(0, 3000),
    blksize=st.sampled_from(["8", "512", "1428"]),
    window=st.sampled_from([None, "1", "4"]),
    evs=events,
)
def test_shared_packets_and_inline_parse_match_the_slow_path(
    size: int, blksize: str, window: str | None, evs: list[tuple[str, bytes]]
) -> None:
    data = bytes(range(256)) * (size // 256 + 1)
    data = data[:size]
    opts = {"blksize": blksize} | ({"windowsize": window} if window else {})
    neg = negotiate(opts, size)
    fast = ReadTransfer(data, neg, packets=PacketCache())
    slow = ReadTransfer(data, neg, packets=None)
    assert fast.start() == slow.start()
    # An honest start first (so the shared packets are used), then the adversarial events.
    first = [("packet", struct.pack("!HH", 4, 0 if neg.oack else 1))]
    for kind, raw in first + evs:
        assert _step(fast, kind, raw) == _step(slow, kind, raw)
        assert (fast.result, fast.acked, fast.sent, fast.budget, fast.retries) == (
            slow.result,
            slow.acked,
            slow.sent,
            slow.budget,
            slow.retries,
        )
        assert (fast.recover, fast.confirmed) == (slow.recover, slow.confirmed)
    assert slow._packets is None
    assert (fast._packets is not None) == fast.confirmed


def test_packets_are_shared_only_after_a_valid_ack_and_bounded() -> None:
    data = bytes(range(256)) * 40  # 10240 bytes
    cache = PacketCache(total_max=3 * PacketCache.cost(len(data), 512))
    neg = negotiate({"blksize": "512", "tsize": "0"}, len(data))
    forged = [ReadTransfer(data, neg, packets=cache) for _ in range(50)]
    for t in forged:
        t.start()
        t.on_timeout()
        t.on_packet(struct.pack("!HH", 4, 7))  # not the OACK's ACK 0: not a confirmation
    assert len(cache) == 0 and all(t._packets is None for t in forged)  # nothing built
    a, b = ReadTransfer(data, neg, packets=cache), ReadTransfer(data, neg, packets=cache)
    for t in (a, b):
        t.start()
        assert t.on_packet(struct.pack("!HH", 4, 0)) == [data_packet(1, data[:512])]
    assert a._packets is b._packets  # one list for every transfer of the file
    assert a._packets == [data_packet(n, data[(n - 1) * 512 : n * 512]) for n in range(1, 22)]
    # Other block sizes: the least recently used list goes, the total stays bounded.
    for bs in ("8", "16", "32", "64"):
        t = ReadTransfer(data, negotiate({"blksize": bs}, len(data)), packets=cache)
        t.start()
        t.on_packet(struct.pack("!HH", 4, 0))
        assert cache.total <= cache.total_max
    assert len(cache) <= 3
    # A big file is not copied into packets: blocks are built as they go.
    big = bytes(PACKETS_FILE_MAX + 1)
    t = ReadTransfer(big, negotiate({}, len(big)), packets=cache)
    t.start()
    assert t.on_packet(struct.pack("!HH", 4, 1)) == [data_packet(2, bytes(512))]
    assert t._packets is None
