"""Coverage-guided fuzzing (atheris, libFuzzer) of the DHCP codec, the full and proxy decision
cores and the proxy server shell. One input is one datagram; the lease table lives across
inputs, so sequences (offer, then request, renew, decline...) are explored too.

    .venv/bin/python tests/boot/fuzz_dhcp.py CORPUS_DIR -max_total_time=600

A crash is any exception other than the codec's ``MalformedPacket`` (the server counts those
and drops the packet), a reply that does not encode, a parsed packet that does not re-encode to
itself, an address bound to two clients, or the server shell's "handler-error" catch-all
firing. tests/boot/test_dhcp_fuzz.py runs this for a few seconds in the normal suite.
"""

from __future__ import annotations

import contextlib
import sys
from ipaddress import IPv4Address, IPv4Network

import atheris

# Only the DHCP code is instrumented (coverage feedback); what it imports from the rest of
# metald and from libraries is loaded plainly first, so start-up takes a second, not half a
# minute.
import metald.boot.metrics  # noqa: E402, F401
import metald.machines  # noqa: E402, F401
import metald.store.db  # noqa: E402, F401

with atheris.instrument_imports(include=["metald.boot.dhcp"]):
    from metald.boot import metrics
    from metald.boot.dhcp.bootfile import BootFiles
    from metald.boot.dhcp.common import NetworkPlan, choose_network
    from metald.boot.dhcp.full import FullHandler
    from metald.boot.dhcp.leasetable import LeaseState, LeaseTable
    from metald.boot.dhcp.packet import MalformedPacket, parse, serialize
    from metald.boot.dhcp.proxy import ProxyHandler
    from metald.boot.dhcp.server import DhcpServer, _Listener

SERVER = IPv4Address("10.0.0.1")
FILES = BootFiles(http_base="http://10.0.0.1:8080")
NETS = [
    NetworkPlan(
        name="prov",
        subnet=IPv4Network("10.0.0.0/24"),
        pool_start=IPv4Address("10.0.0.100"),
        pool_end=IPv4Address("10.0.0.103"),
        lease_seconds=600,
        interface="eth1",
        router=SERVER,
        reservations={"52:54:00:00:00:05": IPv4Address("10.0.0.50")},
    ),
    NetworkPlan(
        name="relayed",
        subnet=IPv4Network("10.0.1.0/24"),
        pool_start=IPv4Address("10.0.1.10"),
        pool_end=IPv4Address("10.0.1.12"),
        lease_seconds=60,
    ),
]
VIEWS = (
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
)


class SinkSocket:
    """The shell's socket: replies are encoded and kept, never sent anywhere."""

    def __init__(self) -> None:
        self.sent = 0

    def sendto(self, data: bytes, dest: tuple[str, int]) -> int:
        parse(data)
        self.sent += 1
        return len(data)

    def fileno(self) -> int:
        return 1


full, proxy, table = FullHandler(SERVER, FILES), ProxyHandler(SERVER, FILES), LeaseTable()
shell = DhcpServer(
    mode="proxy", interfaces=[], networks=NETS, server_id=SERVER, files=FILES, leases=None
)
shell_port = _Listener(SinkSocket(), "eth1", True)  # type: ignore[arg-type]
shell_67 = _Listener(SinkSocket(), "eth1", False)  # type: ignore[arg-type]
handler_errors = metrics.dhcp_dropped.labels("handler-error")
clock = [1000.0]


def check_reply(d) -> None:  # type: ignore[no-untyped-def]
    if d.reply is not None:
        assert parse(serialize(d.reply)).message_type is d.reply.message_type


def one_input(data: bytes) -> None:
    clock[0] += 0.5
    now = clock[0]
    errors = handler_errors._value.get()
    shell.handle_datagram(data, ("10.0.0.9", 68), shell_port)
    shell.handle_datagram(data, ("0.0.0.0", 68), shell_67)
    assert handler_errors._value.get() == errors, "the DHCP shell's catch-all fired"
    try:
        pkt = parse(data)
    except MalformedPacket:
        return
    for name in VIEWS:
        with contextlib.suppress(MalformedPacket):
            getattr(pkt, name)
    if len(pkt.sname) <= 63 and len(pkt.file) <= 127:
        again = parse(serialize(pkt))
        assert again.options == pkt.options and again.chaddr == pkt.chaddr
    try:
        net = choose_network(pkt, "eth1", NETS)
        for on_port in (False, True):
            check_reply(proxy.handle(pkt, net, ("10.0.0.9", 68), on_proxy_port=on_port))
        if net is not None and pkt.message_type is not None:
            check_reply(full.handle(pkt, net, table, now))
    except MalformedPacket:
        return
    for rec in table.records():
        if rec.mac and rec.state is LeaseState.BOUND and rec.holds(now):
            assert table.for_mac(rec.network, rec.mac) is rec, "a client holds two bindings"


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
