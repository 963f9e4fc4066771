"""Fuzzing of the TFTP codec with invariants, in every run of the suite (a few seconds).

Each test states what must hold for *any* input, not just that nothing crashes:
- requests: arbitrary and mutated bytes only ever raise ``MalformedTftp``; valid requests
  round-trip;
- negotiation: every option set ends within the server's limits (blksize, window bytes,
  timeout) and the OACK says exactly what was agreed;
- the transfer machine, driven by an adversarial client (any ACK number, errors, garbage,
  timeouts, repeated requests): it never sends a block outside the window, what an ACK makes it
  send never exceeds what that ACK acknowledged, silence ends it within its budget, and every
  block carries the right bytes; an honest client behind a lossy link gets the exact file;
- admission: caps are never exceeded, a confirmed transfer is evicted only when stale and no
  unconfirmed one is in its scope, and a request is refused only when every transfer in its
  scope is confirmed and fresh;
- the server shell, fed random datagrams from random loopback sources: no exception, and the
  transfers and descriptors it holds stay within its caps.
"""

from __future__ import annotations

import contextlib
import os
import random
import struct

from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from metald.boot.tftp.packet import MalformedTftp, Opcode, negotiate, parse_request
from metald.boot.tftp.server import TftpServer
from metald.boot.tftp.transfer import MAX_RETRIES, UNCONFIRMED_RETRIES, ReadTransfer, Result

from .tftp_invariants import (
    AdmissionOp,
    Event,
    check_negotiation,
    drive_transfer,
    run_admission,
)


def fuzz(examples: int) -> settings:
    """A bounded run: the whole file takes a few seconds in every run of the suite."""
    return settings(
        max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )


# --- requests -----------------------------------------------------------------------------------

names = st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=127), min_size=1, max_size=40)
option_names = st.sampled_from(["blksize", "tsize", "timeout", "windowsize", "x", "BlkSize"])
option_values = st.one_of(
    st.integers(0, 1 << 20).map(str),
    st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=127), max_size=8),
)


def encode(op: int, filename: str, mode: str, options: dict[str, str]) -> bytes:
    body = b"".join(k.encode() + b"\0" + v.encode() + b"\0" for k, v in options.items())
    return struct.pack("!H", op) + filename.encode() + b"\0" + mode.encode() + b"\0" + body


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, str, str, dict[str, str]]:
    filename = draw(names)
    mode = draw(st.sampled_from(["octet", "OCTET", "netascii", "NetAscii"]))
    opts = draw(
        st.dictionaries(
            st.sampled_from(["blksize", "tsize", "timeout", "windowsize", "x"]),
            option_values,
            max_size=5,
        )
    )
    # Option names are case-insensitive: send some in upper case.
    upper = draw(st.sets(st.sampled_from(sorted(opts)))) if opts else set()
    sent = {(k.upper() if k in upper else k): v for k, v in opts.items()}
    return encode(1, filename, mode, sent), filename, mode, opts


@fuzz(400)
@given(requests())
def test_valid_requests_round_trip(r: tuple[bytes, str, str, dict[str, str]]) -> None:
    raw, filename, mode, opts = r
    req = parse_request(raw)
    assert req.opcode is Opcode.RRQ and req.filename == filename and req.mode == mode.lower()
    assert req.options == opts


@fuzz(300)
@given(requests(), st.lists(st.tuples(st.integers(0, 1100), st.integers(0, 255)), max_size=6))
def test_mutated_requests_only_raise_malformed(
    r: tuple[bytes, str, str, dict[str, str]], edits: list[tuple[int, int]]
) -> None:
    raw = bytearray(r[0])
    for pos, byte in edits:
        if pos < len(raw):
            raw[pos] = byte
        elif pos % 3 == 0:
            del raw[pos % max(1, len(raw)) :]
        else:
            raw += bytes([byte]) * (pos % 64)
    with contextlib.suppress(MalformedTftp):
        parse_request(bytes(raw))


# --- negotiation --------------------------------------------------------------------------------


@fuzz(300)
@given(
    st.dictionaries(
        st.sampled_from(["blksize", "tsize", "timeout", "windowsize", "other"]), option_values
    ),
    st.integers(0, 1 << 40),
)
def test_negotiation_stays_within_limits(options: dict[str, str], size: int) -> None:
    check_negotiation(options, size)


# --- the transfer machine against an adversarial client --------------------------------------

events = st.lists(
    st.one_of(
        st.tuples(st.just("ack"), st.integers(0, 0xFFFF)),
        # Relative to the acked block: mostly small steps, as a client that ACKs one block
        # at a time (the amplification attack) or a little behind (duplicates) would send.
        st.tuples(st.just("ack-near"), st.integers(-2, 3)),
        st.tuples(st.just("ack-near"), st.integers(-2, 3)),
        st.tuples(st.just("ack-near"), st.integers(-3, 70)),
        st.tuples(st.just("timeout"), st.just(0)),
        st.tuples(st.just("rrq"), st.just(0)),
        st.tuples(st.just("garbage"), st.binary(max_size=6)),
        st.tuples(st.just("error"), st.just(0)),
    ),
    max_size=120,
)


@fuzz(500)
@given(
    st.one_of(st.integers(0, 1500), st.integers(0, 6000)),
    st.sampled_from([8, 64, 512, 1432]),
    st.integers(1, 70),
    st.booleans(),
    events,
)
def test_transfer_machine_invariants(
    size: int, blksize: int, window: int, with_oack: bool, evs: list[Event]
) -> None:
    opts = {"blksize": str(blksize), "windowsize": str(window)} if with_oack else {}
    d = drive_transfer(size, opts, evs)
    # Steer the search toward the amplification bounds (targeted property-based testing).
    target(d.ack_resends / d.transfer.nblocks, label="ACK-triggered resends per block")
    target(d.total_data / (d.transfer.nblocks + d.budget), label="sent / allowed")


@fuzz(300)
@given(
    st.integers(0, 20000),
    st.sampled_from([(512, 1), (1432, 1), (1468, 4), (64, 16)]),
    st.floats(0, 0.10),
    st.integers(0, 2**32),
)
def test_honest_client_over_a_lossy_link_gets_the_file(
    size: int, shape: tuple[int, int], loss: float, seed: int
) -> None:
    """An RFC 7440 receiver: takes blocks in order, ACKs at the end of each window and at the
    last block, ACKs its last in-order block when one is missing, and when it hears nothing
    re-ACKs it (or repeats its request before anything came). Packets in both directions are
    lost at random (up to 10 %); the transfer completes with the exact bytes, or gives up only
    by the consecutive-timeouts rule, never for want of retransmission budget."""
    blksize, window = shape
    data = os.urandom(size)
    t = ReadTransfer(data, negotiate({"blksize": str(blksize), "windowsize": str(window)}, size))
    w = t.window
    rnd = random.Random(seed)
    drops = iter(lambda: rnd.random() < loss, None)
    got = bytearray()
    have = 0  # last in-order block
    since_ack = 0
    started = False  # the client heard the OACK
    quiet = 0  # consecutive timeouts with no progress between them
    acked_before_timeout = -1
    wire = t.start()
    for _ in range(100_000):
        if t.done:
            break
        to_server: list[bytes] = []
        gap = False
        for p in wire:
            if next(drops):
                continue
            if p[:2] == b"\0\6":
                started = True
                to_server = [struct.pack("!HH", 4, 0)]
                continue
            n, payload = struct.unpack("!H", p[2:4])[0], p[4:]
            if n == (have + 1) & 0xFFFF:
                started = True
                have += 1
                got += payload
                since_ack += 1
                if since_ack == w or len(payload) < blksize:
                    since_ack = 0
                    to_server = [struct.pack("!HH", 4, have & 0xFFFF)]
            elif not gap and (n - have) & 0xFFFF < 0x8000:
                # A block past a missing one: ACK the last in-order block, once (RFC 7440).
                gap = True
                since_ack = 0
                to_server = [struct.pack("!HH", 4, have & 0xFFFF)]
        wire = []
        for a in to_server:
            if not next(drops):
                wire += t.on_packet(a)
        if not wire and not t.done:
            # Nothing more is coming: both ends time out.
            quiet = quiet + 1 if t.acked == acked_before_timeout else 1
            acked_before_timeout = t.acked
            wire = t.on_timeout()
            if not next(drops):
                if started:
                    wire += t.on_packet(struct.pack("!HH", 4, have & 0xFFFF))
                else:
                    wire += t.on_repeated_request()
    if t.result is Result.TIMEOUT:
        # Allowed only by the give-up rules (the same packet lost on every retry; a real
        # client then repeats its request, which starts a new transfer), never by running out
        # of budget.
        if t.confirmed:
            assert quiet > MAX_RETRIES, (t.acked, t.nblocks, t.budget)
        else:
            assert t.repeats > UNCONFIRMED_RETRIES
        return
    assert t.result is Result.OK
    assert bytes(got) == data


# --- admission ----------------------------------------------------------------------------------


@fuzz(300)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["admit", "admit", "confirm", "confirm", "remove", "tick"]),
            st.integers(0, 50),
        ),
        max_size=60,
    )
)
def test_admission_invariants(ops: list[AdmissionOp]) -> None:
    run_admission(ops)


# --- the server shell ---------------------------------------------------------------------------


@st.composite
def datagrams(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=80))
    name = draw(st.sampled_from(["f", "big", "../f", "nope", "f\\..\\..\\x"]))
    mode = draw(st.sampled_from(["octet", "netascii", "mail"]))
    opts = draw(st.dictionaries(option_names, option_values, max_size=4))
    op = 2 if kind == 3 else 1
    return encode(op, name, mode, opts)


def test_server_shell_under_random_datagrams(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    root = tmp_path / "root"
    root.mkdir()
    (root / "f").write_bytes(os.urandom(3000))
    with (root / "big").open("wb") as f:
        f.truncate(2 << 20)

    async def main() -> None:
        server = TftpServer(root, host="127.0.0.1", port=0, max_transfers=20, max_per_client=4)
        server.cache.file_max = 1 << 20  # "big" is served by pread
        await server.start()
        listener = server._socks[0][0]
        fds0 = len(os.listdir("/proc/self/fd"))

        @fuzz(150)
        @given(st.lists(st.tuples(datagrams(), st.integers(2, 9), st.integers(1, 4)), max_size=20))
        def feed(batch: list[tuple[bytes, int, int]]) -> None:
            for data, host, port in batch:
                server._request(listener, data, (f"127.0.9.{host}", 40000 + port), "127.0.0.1", "")
                assert len(server.table) <= 20
                for h in range(2, 10):
                    assert server.table.count(f"127.0.9.{h}") <= 4
            # One socket per transfer, one shared descriptor for the big file: nothing else.
            assert len(os.listdir("/proc/self/fd")) - fds0 <= len(server.table) + 1

        try:
            feed()
        finally:
            await server.stop()
        assert len(server.table) == 0 and server.cache.open_fds == 0

    asyncio.run(main())
