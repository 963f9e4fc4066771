"""Structure-aware fuzzing of the DHCP codec, the full and proxy decision cores and the
server shell, bounded to a few seconds in the normal suite.

Packets are generated the way a hostile or broken client would write them: plausible headers
and option streams (the options the server reads, with right and wrong lengths, overload into
file/sname, option 82 sub-options, RFC 3004 and iPXE user classes), then cut and bit-flipped.
The properties:
- the codec raises nothing but ``MalformedPacket``, and what it parses re-encodes to the same
  header and options;
- the decision cores raise nothing but ``MalformedPacket`` over sequences of such packets
  against one lease table, every reply encodes and decodes, and no address is bound to two
  clients;
- the server shell never raises, counts every malformed datagram as dropped, and never hits
  its "handler-error" catch-all.

``METALD_FUZZ_EXAMPLES`` (default below) runs longer, e.g. overnight.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metald.boot import metrics
from metald.boot.dhcp.bootfile import BootFiles
from metald.boot.dhcp.common import NetworkPlan, choose_network
from metald.boot.dhcp.full import FullHandler
from metald.boot.dhcp.leasetable import LeaseState, LeaseTable
from metald.boot.dhcp.packet import (
    BROADCAST_FLAG,
    MAGIC_COOKIE,
    MalformedPacket,
    MessageType,
    Opt,
    encode_tlv,
    parse,
    serialize,
)
from metald.boot.dhcp.proxy import ProxyHandler
from metald.boot.hooks import MemoryBootHooks
from metald.store import Store

from .dhcp_helpers import HTTP_UEFI, IPXE_BIOS, PXE_BIOS, PXE_UEFI, client_packet
from .test_dhcp_server import start

EXAMPLES = int(os.environ.get("METALD_FUZZ_EXAMPLES", "0")) or None


def fuzz_settings(default: int):  # type: ignore[no-untyped-def]
    return settings(
        max_examples=EXAMPLES or default,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
    )


# -- packet generation --------------------------------------------------------------------

SERVER = IPv4Address("10.0.0.1")
CORE_ADDRS = [0, 0x0A000001, 0x0A000064, 0x0A000065, 0x0A000067, 0x0A0000FE, 0xC0A80005, 0xFFFFFFFF]
SHELL_ADDRS = [0, 0x7F000001, 0x7F000101, 0x7F000102, 0x7F000902, 0x7F0000FE]
MACS = [bytes.fromhex(f"5254000000{i:02x}") for i in range(6)]
ARCHS = [0, 6, 7, 9, 10, 11, 16, 19, 0xFFFF]


def addr(choices: list[int]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.sampled_from(choices).map(lambda a: a.to_bytes(4, "big")),
        st.binary(min_size=4, max_size=4),
    )


def tlv(items: st.SearchStrategy[list[tuple[int, bytes]]]) -> st.SearchStrategy[bytes]:
    return items.map(lambda xs: b"".join(bytes((c, len(v) & 255)) + v[:255] for c, v in xs))


def option_value(code: int, addrs: list[int]) -> st.SearchStrategy[bytes]:
    junk = st.binary(max_size=24)
    by_code: dict[int, st.SearchStrategy[bytes]] = {
        Opt.MESSAGE_TYPE: st.integers(0, 10).map(lambda t: bytes((t,))),
        Opt.REQUESTED_IP: addr(addrs),
        Opt.SERVER_ID: addr(addrs),
        Opt.OVERLOAD: st.sampled_from([b"\x01", b"\x02", b"\x03", b"\x00", b"\x01\x02"]),
        Opt.CLIENT_ARCH: st.lists(st.sampled_from(ARCHS), min_size=1, max_size=3).map(
            lambda xs: b"".join(x.to_bytes(2, "big") for x in xs)
        ),
        Opt.USER_CLASS: st.one_of(
            st.just(b"iPXE"),
            tlv(st.lists(st.tuples(st.just(0), st.sampled_from([b"iPXE", b"x"])), max_size=2)).map(
                lambda b: b.replace(b"\x00", b"", 1)
            ),
        ),
        Opt.VENDOR_CLASS: st.sampled_from(
            [b"PXEClient:Arch:00000:UNDI:002001", b"PXEClient:Arch:00007", b"HTTPClient", b"udhcp"]
        ),
        Opt.CLIENT_UUID: st.one_of(st.binary(min_size=16, max_size=16).map(b"\x00".__add__), junk),
        Opt.RELAY_AGENT: tlv(
            st.lists(
                st.tuples(
                    st.sampled_from([1, 2, 5, 9]),
                    st.one_of(addr(addrs), st.binary(max_size=10)),
                ),
                max_size=3,
            )
        ),
        Opt.HOSTNAME: st.text(max_size=10).map(lambda s: s.encode()),
    }
    return st.one_of(by_code.get(code, junk), junk)


CODES = [
    Opt.MESSAGE_TYPE,
    Opt.REQUESTED_IP,
    Opt.SERVER_ID,
    Opt.OVERLOAD,
    Opt.CLIENT_ARCH,
    Opt.USER_CLASS,
    Opt.VENDOR_CLASS,
    Opt.CLIENT_UUID,
    Opt.RELAY_AGENT,
    Opt.HOSTNAME,
    Opt.CLIENT_ID,
    Opt.PARAM_REQUEST,
    Opt.PAD,
]


@st.composite
def options_stream(draw, addrs: list[int]) -> bytes:  # type: ignore[no-untyped-def]
    out = b""
    if draw(st.booleans()):  # most packets have a message type first
        out += b"\x35\x01" + bytes((draw(st.sampled_from([1, 3, 4, 7, 8, 2, 5])),))
    for _ in range(draw(st.integers(0, 6))):
        code = draw(st.one_of(st.sampled_from(CODES), st.integers(0, 255)))
        if code == Opt.PAD:
            out += b"\x00"
            continue
        if code == Opt.END:
            out += b"\xff"
            continue
        v = draw(option_value(code, addrs))
        length = draw(st.one_of(st.just(len(v)), st.integers(0, 255)))  # sometimes a lie
        out += bytes((code, min(length, 255))) + v[:255]
    if draw(st.booleans()):
        out += b"\xff"
    return out


@st.composite
def datagrams(draw, addrs: list[int] = CORE_ADDRS) -> bytes:  # type: ignore[no-untyped-def]
    """One datagram as a client (or relay) might send it, maybe damaged."""
    fields = [
        draw(st.sampled_from([1, 1, 1, 2, 0, 7])),  # op
        draw(st.sampled_from([1, 1, 6, 32, 0])),  # htype
        draw(st.sampled_from([6, 6, 6, 0, 16, 17, 3])),  # hlen
        draw(st.integers(0, 255)),  # hops
    ]
    head = bytes(fields) + draw(st.binary(min_size=4, max_size=4))  # xid
    head += draw(st.integers(0, 65535)).to_bytes(2, "big")  # secs
    head += draw(st.sampled_from([0, 0x8000, 0xFFFF])).to_bytes(2, "big")  # flags
    for _ in range(4):  # ciaddr yiaddr siaddr giaddr
        head += draw(st.sampled_from([0, 0, *addrs])).to_bytes(4, "big")
    head += draw(st.one_of(st.sampled_from(MACS), st.binary(min_size=6, max_size=6))).ljust(
        16, b"\x00"
    )
    field_opts = st.one_of(st.just(b""), options_stream(addrs), st.binary(max_size=128))
    sname = draw(field_opts)[:64].ljust(64, b"\x00")
    file = draw(field_opts)[:128].ljust(128, b"\x00")
    cookie = draw(st.sampled_from([MAGIC_COOKIE] * 9 + [b"\x63\x82\x53\x00"]))
    data = bytearray(head + sname + file + cookie + draw(options_stream(addrs)))
    for i, v in draw(
        st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 255)), max_size=3)
    ):
        data[i] = v
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    return bytes(data if cut is None else data[:cut])


# -- codec ----------------------------------------------------------------------------------


def views(p) -> None:  # type: ignore[no-untyped-def]
    """Every typed view the server reads; each may raise MalformedPacket only."""
    for name in (
        "message_type",
        "mac",
        "broadcast",
        "requested_ip",
        "server_id",
        "client_archs",
        "vendor_class",
        "user_classes",
        "client_uuid",
        "relay_agent",
        "hostname",
    ):
        with contextlib.suppress(MalformedPacket):
            getattr(p, name)


@fuzz_settings(100)
@given(datagrams())
def test_codec_raises_only_its_own_error_and_round_trips(data: bytes) -> None:
    try:
        p = parse(data)
    except MalformedPacket as e:
        assert e.reason and " " not in e.reason  # a metric label
        return
    views(p)
    if len(p.sname) > 63 or len(p.file) > 127:
        return  # a full-width field with no NUL: serialize() is for replies, which never are
    again = parse(serialize(p))
    assert again.options == p.options
    assert (again.op, again.xid, again.flags, again.ciaddr, again.giaddr, again.chaddr) == (
        p.op,
        p.xid,
        p.flags,
        p.ciaddr,
        p.giaddr,
        p.chaddr,
    )


# -- decision cores -------------------------------------------------------------------------


def core_net(**kw) -> NetworkPlan:  # type: ignore[no-untyped-def]
    args = dict(
        name="prov",
        subnet=IPv4Network("10.0.0.0/24"),
        pool_start=IPv4Address("10.0.0.100"),
        pool_end=IPv4Address("10.0.0.103"),
        lease_seconds=600,
        interface="eth1",
        router=SERVER,
        reservations={"52:54:00:00:00:05": IPv4Address("10.0.0.50")},
    )
    args.update(kw)
    return NetworkPlan(**args)  # type: ignore[arg-type]


FILES = BootFiles(http_base="http://10.0.0.1:8080")


def check_reply(d) -> None:  # type: ignore[no-untyped-def]
    if d.reply is None:
        return
    back = parse(serialize(d.reply))
    assert back.message_type is d.reply.message_type
    host, port = d.dest
    assert isinstance(host, str) and port in (67, 68)


@fuzz_settings(30)
@given(st.lists(st.tuples(datagrams(), st.integers(0, 300)), min_size=1, max_size=12))
def test_decision_cores_raise_only_malformed_and_never_double_bind(seq) -> None:  # type: ignore[no-untyped-def]
    nets = [core_net(), core_net(name="relayed", subnet=IPv4Network("10.0.0.0/25"), interface="")]
    full, proxy, table = FullHandler(SERVER, FILES), ProxyHandler(SERVER, FILES), LeaseTable()
    now = 1000.0
    for data, dt in seq:
        now += dt
        try:
            pkt = parse(data)
            net = choose_network(pkt, "eth1", nets)
            for on_proxy_port in (False, True):
                check_reply(proxy.handle(pkt, net, ("10.0.0.9", 68), on_proxy_port=on_proxy_port))
            if net is not None and pkt.message_type is not None:
                check_reply(full.handle(pkt, net, table, now))
        except MalformedPacket:
            continue
        held = [r for r in table.records() if r.holds(now) and r.state is LeaseState.BOUND]
        for r in held:
            if r.mac:
                assert table.for_mac(r.network, r.mac) is r  # one binding per client


# -- the server shell -----------------------------------------------------------------------


def counter_total(counter) -> float:  # type: ignore[no-untyped-def]
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def test_server_shell_drops_and_counts_malformed_and_never_crashes(tmp_path: Path) -> None:
    """Full mode, real lease store and hooks: every datagram is handled or dropped and
    counted, and the shell's catch-all never fires."""
    store = Store(f"sqlite:///{tmp_path / 'metald.db'}")
    store.migrate()
    loop = asyncio.new_event_loop()
    srv, relay, leases = loop.run_until_complete(start(store, MemoryBootHooks()))
    lst = srv._listeners[0]
    crashed = metrics.dhcp_dropped.labels("handler-error")

    async def feed(packets: list[bytes]) -> None:
        for data in packets:
            before, dropped = crashed._value.get(), counter_total(metrics.dhcp_dropped)
            srv.handle_datagram(data, ("127.0.0.1", 67), lst)
            assert crashed._value.get() == before
            try:
                parse(data)
            except MalformedPacket:
                assert counter_total(metrics.dhcp_dropped) == dropped + 1
        await leases.drain()

    @fuzz_settings(40)
    @given(st.lists(datagrams(SHELL_ADDRS), min_size=1, max_size=10))
    def run(packets: list[bytes]) -> None:
        loop.run_until_complete(feed(packets))

    try:
        run()
    finally:
        loop.run_until_complete(srv.stop())
        leases.close()
        relay.close()
        store.close()
        loop.close()


# -- coverage-guided ------------------------------------------------------------------------


def seed_corpus() -> list[bytes]:
    """Realistic packets of every kind the server reads, for the fuzzer to start from."""
    relay_info = {Opt.RELAY_AGENT: encode_tlv({1: b"swp7", 2: b"leaf-3", 5: SERVER.packed})}
    ip, relay = IPv4Address("10.0.0.100"), IPv4Address("10.0.1.1")
    sel = {Opt.REQUESTED_IP: ip.packed, Opt.SERVER_ID: SERVER.packed}
    pkts = [
        client_packet(MessageType.DISCOVER, options=IPXE_BIOS),
        client_packet(MessageType.DISCOVER, options=PXE_UEFI, flags=BROADCAST_FLAG),
        client_packet(MessageType.DISCOVER, options={**HTTP_UEFI, **relay_info}, giaddr=relay),
        client_packet(MessageType.REQUEST, options={**PXE_BIOS, **sel}),
        client_packet(MessageType.REQUEST, options={Opt.REQUESTED_IP: ip.packed}),
        client_packet(MessageType.REQUEST, ciaddr=ip),
        client_packet(MessageType.REQUEST, ciaddr=ip, giaddr=relay, options=relay_info),
        client_packet(MessageType.DECLINE, options=sel),
        client_packet(MessageType.RELEASE, ciaddr=ip, options={Opt.SERVER_ID: SERVER.packed}),
        client_packet(MessageType.INFORM, ciaddr=ip, options=IPXE_BIOS),
        client_packet(MessageType.REQUEST, options={**PXE_UEFI, Opt.CLIENT_UUID: bytes(17)}),
    ]
    out = [serialize(p) for p in pkts]
    # Overload: options continued in file and sname.
    raw = bytearray(serialize(client_packet(MessageType.DISCOVER)))
    raw[240:] = b"\x35\x01\x01\x34\x01\x03\xff"
    raw[108:236] = (b"\x0c\x03abc\xff").ljust(128, b"\x00")
    raw[44:108] = (b"\x3c\x09PXEClient\xff").ljust(64, b"\x00")
    return [*out, bytes(raw)]


FUZZ_SECONDS = int(os.environ.get("METALD_FUZZ_SECONDS", "3"))


def test_coverage_guided_fuzzing_of_codec_cores_and_shell(tmp_path: Path) -> None:
    """tests/boot/fuzz_dhcp.py under libFuzzer for a few seconds (METALD_FUZZ_SECONDS)."""
    pytest.importorskip("atheris", reason="atheris (dev extra) is not installed")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, data in enumerate(seed_corpus()):
        (corpus / f"seed-{i}").write_bytes(data)
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("fuzz_dhcp.py")),
            str(corpus),
            f"-max_total_time={FUZZ_SECONDS}",
            "-use_value_profile=1",
            "-max_len=800",
            "-seed=1",
            f"-artifact_prefix={tmp_path}/",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=FUZZ_SECONDS + 120,
    )
    crashes = [p for p in tmp_path.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-"))]
    detail = "".join(f"\n{p.name}: {p.read_bytes().hex()}" for p in crashes)
    assert proc.returncode == 0 and not crashes, proc.stderr[-4000:] + detail
    runs = re.search(r"Done (\d+) runs", proc.stderr)
    assert runs and int(runs.group(1)) > 0, proc.stderr[-2000:]
