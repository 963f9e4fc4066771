"""Router Advertisements: the packet, and the responder answering a solicitation in a netns."""

from __future__ import annotations

import sys
from ipaddress import IPv6Network
from pathlib import Path

import pytest

from metald.boot.ra import ICMPV6_RA, build_ra, is_router_solicitation
from vmlab.labnet import NEED_ROOT, ROOT, BootProcess, namespaces, veth, write_config


def test_ra_packet_layout() -> None:
    ra = build_ra(bytes.fromhex("525400000001"), IPv6Network("fd00:10::/64"))
    assert ra[0] == ICMPV6_RA and ra[4] == 64 and ra[5] == 0  # hop limit, M=O=0
    assert ra[6:8] == b"\x00\x00"  # router lifetime 0: not a default router
    assert ra[16:24] == b"\x01\x01" + bytes.fromhex("525400000001")
    assert ra[24:26] == b"\x03\x04" and ra[26] == 64 and ra[27] == 0xC0
    assert ra[40:56] == IPv6Network("fd00:10::/64").network_address.packed
    assert is_router_solicitation(b"\x85\x00\x00\x00\x00\x00\x00\x00", 255)
    assert not is_router_solicitation(b"\x85\x00\x00\x00\x00\x00\x00\x00", 64)  # routed: forged
    assert not is_router_solicitation(b"\x85\x00", 255)


RS_PROBE = r"""
import socket, struct, time
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
s.setsockopt(socket.SOL_SOCKET, 25, b"vc")
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, 255)
s.settimeout(0.5)
idx = socket.if_nametoindex("vc")
t0 = time.monotonic()
while time.monotonic() - t0 < 10:
    try:
        s.sendto(b"\x85\x00\x00\x00\x00\x00\x00\x00", ("ff02::2", 0, 0, idx))
    except OSError:
        time.sleep(0.2); continue
    try:
        while True:
            d, a = s.recvfrom(1500)
            if d[0] == 134:
                print("RA", a[0].split("%")[0], d[6:8].hex(), d[16:18].hex(), d[24:26].hex(), round(time.monotonic() - t0, 2)); raise SystemExit
    except TimeoutError:
        pass
print("none")
"""


@pytest.mark.root
@pytest.mark.skipif(not ROOT, reason=NEED_ROOT)
def test_solicitation_is_answered(tmp_path: Path, assets: Path) -> None:
    boot = f"""
[boot]
enabled = true
dhcp_mode = "off"
interfaces = ["vs"]
server_address = "10.78.0.1"
assets_dir = "{assets}"
router_advertisements = true
ra_prefix = "fd00:78::/64"
"""
    with namespaces("srv", "cli") as ns:
        for n in ns.values():
            n.run(
                "sysctl",
                "-qw",
                "net.ipv6.conf.all.accept_dad=0",
                "net.ipv6.conf.default.accept_dad=0",
            )
        veth(ns["srv"], "vs", "10.78.0.1/24", ns["cli"], "vc", "10.78.0.2/24")
        cfg = write_config(
            tmp_path / "m.toml", state_dir=tmp_path / "st", boot=boot, listen="10.78.0.1:8081"
        )
        proc = BootProcess(ns["srv"], cfg, tmp_path / "m.log").start()
        try:
            out = ns["cli"].run(sys.executable, "-c", RS_PROBE, timeout=20).stdout.split()
            assert out[0] == "RA", out
            assert out[1].startswith("fe80::")  # from the server's link-local address
            assert out[2] == "0000" and out[3] == "0101"  # lifetime 0, source lladdr option
            assert out[4] == "0304"  # then the prefix
        finally:
            proc.stop()
