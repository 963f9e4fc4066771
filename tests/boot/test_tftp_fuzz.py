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
- admission: caps are never exceeded, a confirmed transfer is never evicted, and a request is
  refused only when every transfer in its scope is confirmed;
- the server shell, fed random datagrams from random loopback sources: no exception, and the
  transfers and descriptors it holds stay within its caps.
"""

from __future__ import annotations

import contextlib
import os
import random
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from metald.boot.tftp.admission import TransferTable
from metald.boot.tftp.packet import (
    MAX_BLKSIZE,
    MAX_TIMEOUT,
    MAX_WINDOW,
    MAX_WINDOW_BYTES,
    MIN_BLKSIZE,
    MalformedTftp,
    Opcode,
    negotiate,
    parse_request,
)
from metald.boot.tftp.server import TftpServer
from metald.boot.tftp.transfer import MAX_RETRIES, UNCONFIRMED_RETRIES, ReadTransfer, Result


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


@fuzz(800)
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


@fuzz(600)
@given(
    st.dictionaries(
        st.sampled_from(["blksize", "tsize", "timeout", "windowsize", "other"]), option_values
    ),
    st.integers(0, 1 << 40),
)
def test_negotiation_stays_within_limits(options: dict[str, str], size: int) -> None:
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


# --- the transfer machine against an adversarial client --------------------------------------

events = st.lists(
    st.one_of(
        st.tuples(st.just("ack"), st.integers(0, 0xFFFF)),
        st.tuples(st.just("ack-near"), st.integers(-3, 70)),  # relative to the acked block
        st.tuples(st.just("timeout"), st.just(0)),
        st.tuples(st.just("rrq"), st.just(0)),
        st.tuples(st.just("garbage"), st.binary(max_size=6).map(len)),
        st.tuples(st.just("error"), st.just(0)),
    ),
    max_size=120,
)


def data_blocks(pkts: list[bytes]) -> list[tuple[int, bytes]]:
    return [(struct.unpack("!H", p[2:4])[0], p[4:]) for p in pkts if p[:2] == b"\0\3"]


@fuzz(500)
@given(
    st.integers(0, 6000),
    st.sampled_from([8, 64, 512, 1432]),
    st.integers(1, 70),
    st.booleans(),
    events,
)
def test_transfer_machine_invariants(
    size: int, blksize: int, window: int, with_oack: bool, evs: list[tuple[str, int]]
) -> None:
    data = os.urandom(size)
    opts = {"blksize": str(blksize), "windowsize": str(window)} if with_oack else {}
    t = ReadTransfer(data, negotiate(opts, size))
    w = t.window
    budget0 = t.budget
    assert budget0 <= 4 * t.nblocks + 4 * w
    ack_resends = 0
    first = t.start()
    assert len(data_blocks(first)) <= 1
    total_data = len(data_blocks(first))
    quiet = 0  # timeouts since the last progress
    for kind, arg in evs:
        was_done, acked0, sent0, confirmed0 = t.done, t.acked, t.sent, t.confirmed
        if kind in ("ack", "ack-near"):
            n = arg if kind == "ack" else (t.acked + arg) & 0xFFFF
            out = t.on_packet(struct.pack("!HH", 4, n))
        elif kind == "timeout":
            out = t.on_timeout()
        elif kind == "rrq":
            out = t.on_repeated_request()
        elif kind == "error":
            out = t.on_packet(b"\0\5\0\0bye\0")
            assert t.result is Result.CLIENT_ERROR or was_done
        else:
            try:
                out = t.on_packet(os.urandom(arg))
            except MalformedTftp:
                out = []
        if was_done:
            assert out == []
            continue
        blocks = data_blocks(out)
        total_data += len(blocks)
        for n, payload in blocks:  # files here stay under 65536 blocks: no rollover
            assert t.acked < n <= t.acked + w and n <= t.nblocks
            assert payload == data[(n - 1) * t.blksize : n * t.blksize]
        new = [n for n, _ in blocks if n > sent0]
        if kind in ("ack", "ack-near"):
            ack_resends += len(blocks) - len(new)
            # An ACK sends blocks never sent only as far as it acknowledged (plus the first
            # window when it confirms the transfer); anything else it sends is a resend.
            assert len(new) <= (t.acked - acked0) + (w if not confirmed0 else 0)
            assert t.sent >= sent0
        else:
            assert not new and len(blocks) <= w
        if t.acked > acked0 or (t.confirmed and not confirmed0):
            quiet = 0
        elif kind == "timeout":
            quiet += 1
            limit = MAX_RETRIES if t.confirmed else UNCONFIRMED_RETRIES
            assert quiet <= limit or t.done
    # Every resend, on a timeout, a repeated request or a partial ACK, came out of one budget;
    # ACKs alone (at the client's pace, no timer) never made the server resend more than the
    # file once: a window is restarted only by an ACK beyond the last restart.
    assert total_data <= t.nblocks + budget0
    assert ack_resends <= t.nblocks


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
        # Allowed only by the give-up rule (the same packet lost on every retry; a real client
        # then repeats its request), never by running out of budget.
        limit = MAX_RETRIES if t.confirmed else UNCONFIRMED_RETRIES
        assert quiet > limit, (t.acked, t.nblocks, t.budget)
        return
    assert t.result is Result.OK
    assert bytes(got) == data


# --- admission ----------------------------------------------------------------------------------


class AdmissionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table: TransferTable[int] = TransferTable(max_total=6, max_per_client=3)
        self.addr: dict[int, str] = {}
        self.confirmed: set[int] = set()
        self.next = 0

    @rule(addr=st.sampled_from(["a", "b", "c", "d"]))
    def admit(self, addr: str) -> None:
        key = self.next
        self.next += 1
        mine = [k for k, a in self.addr.items() if a == addr]
        adm = self.table.admit(key, addr)
        for k in adm.evicted:
            assert k not in self.confirmed, "a confirmed transfer was evicted"
            del self.addr[k]
        if adm.admitted:
            self.addr[key] = addr
        elif adm.reason == "refused-per-client":
            assert len(mine) == 3 and all(k in self.confirmed for k in mine)
        else:
            assert adm.reason == "busy" and len(self.addr) == 6
            assert all(k in self.confirmed for k in self.addr)

    @precondition(lambda self: bool(self.addr))
    @rule(i=st.integers(0, 100))
    def confirm(self, i: int) -> None:
        key = sorted(self.addr)[i % len(self.addr)]
        self.table.confirm(key)
        self.confirmed.add(key)

    @precondition(lambda self: bool(self.addr))
    @rule(i=st.integers(0, 100))
    def remove(self, i: int) -> None:
        key = sorted(self.addr)[i % len(self.addr)]
        self.table.remove(key)
        del self.addr[key]
        self.confirmed.discard(key)

    @invariant()
    def within_caps(self) -> None:
        assert len(self.table) == len(self.addr) <= 6
        for a in "abcd":
            assert self.table.count(a) == sum(1 for x in self.addr.values() if x == a) <= 3
        assert self.table.unconfirmed == len(set(self.addr) - self.confirmed)


TestAdmission = AdmissionMachine.TestCase
TestAdmission.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


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

        @fuzz(300)
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
