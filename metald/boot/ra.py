"""IPv6 Router Advertisements on the boot interfaces.

iPXE waits about 16 s for IPv6 autoconfiguration on a network with no router before it goes on
to boot (LAB-NOTES). One RA, even one that says "I am not a default router" (lifetime 0) and
"no DHCPv6" (M and O clear), ends that wait at once. We answer Router Solicitations and also
advertise now and then unsolicited. ``build_ra``/``is_router_solicitation`` are pure.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import time
from ipaddress import IPv6Network

from metald.boot import metrics
from metald.boot.netutil import SO_BINDTODEVICE

log = logging.getLogger(__name__)

ICMPV6_RS = 133
ICMPV6_RA = 134
ALL_NODES = "ff02::1"
ALL_ROUTERS = "ff02::2"
#: RFC 4861 6.2.6: at most one multicast RA per this many seconds (we answer faster than the
#: RFC's 3 s because a whole rack solicits at once and one multicast RA answers all of them).
MIN_RA_GAP = 0.5
UNSOLICITED_INTERVAL = 30.0
IPV6_RECVHOPLIMIT = getattr(socket, "IPV6_RECVHOPLIMIT", 51)
IPV6_HOPLIMIT = getattr(socket, "IPV6_HOPLIMIT", 52)
SIOCGIFHWADDR = 0x8927


def build_ra(mac: bytes | None, prefix: IPv6Network | None = None, *, lifetime: int = 0) -> bytes:
    """An RA: hop limit 64, M=O=0, router ``lifetime`` (0: not a default router), source
    link-layer option, and an on-link autonomous prefix when given. Checksum left 0: the
    kernel fills it in for raw ICMPv6 sockets."""
    msg = struct.pack("!BBHBBHII", ICMPV6_RA, 0, 0, 64, 0, lifetime, 0, 0)
    if mac:
        msg += struct.pack("!BB", 1, 1) + mac
    if prefix is not None:
        msg += (
            struct.pack("!BBBBIII", 3, 4, prefix.prefixlen, 0xC0, 86400, 14400, 0)
            + prefix.network_address.packed
        )
    return msg


def is_router_solicitation(data: bytes, hop_limit: int | None) -> bool:
    """RFC 4861 6.1.1: type 133, code 0, at least 8 bytes, hop limit 255 (never routed)."""
    return (
        len(data) >= 8
        and data[0] == ICMPV6_RS
        and data[1] == 0
        and (hop_limit is None or hop_limit == 255)
    )


def _iface_mac(sock: socket.socket, iface: str) -> bytes | None:
    """The interface's hardware address, asked through the socket (so in its namespace;
    /sys may show another one)."""
    try:
        req = struct.pack("256s", iface.encode()[:15])
        return fcntl.ioctl(sock.fileno(), SIOCGIFHWADDR, req)[18:24]
    except OSError:
        return None


class RaResponder:
    name = "ra"

    def __init__(self, interfaces: list[str], prefix: IPv6Network | None = None) -> None:
        self.interfaces = interfaces
        self.prefix = prefix
        self._socks: dict[str, socket.socket] = {}
        self._last: dict[str, float] = {}
        self._pending: dict[str, asyncio.TimerHandle] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for iface in self.interfaces:
            try:
                self._socks[iface] = self._open(iface)
            except OSError as e:
                # IPv6 off on this interface: iPXE will wait, but DHCPv4 boot still works.
                log.warning("no Router Advertisements on %s: %s", iface, e)
                continue
            self._loop.add_reader(self._socks[iface].fileno(), self._readable, iface)
        self._ticker = self._loop.create_task(self._tick())

    def _open(self, iface: str) -> socket.socket:
        idx = socket.if_nametoindex(iface)
        s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, iface.encode())
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, 255)
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS, 255)
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, idx)
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_LOOP, 0)
            s.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVHOPLIMIT, 1)
            mreq = socket.inet_pton(socket.AF_INET6, ALL_ROUTERS) + struct.pack("@I", idx)
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_JOIN_GROUP, mreq)
            s.setblocking(False)
        except BaseException:
            s.close()
            raise
        return s

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        for h in self._pending.values():
            h.cancel()
        for s in self._socks.values():
            if self._loop is not None:
                self._loop.remove_reader(s.fileno())
            s.close()
        self._socks.clear()

    async def _tick(self) -> None:
        while True:
            for iface in list(self._socks):
                self._advertise(iface, "periodic")
            await asyncio.sleep(UNSOLICITED_INTERVAL)

    def _readable(self, iface: str) -> None:
        s = self._socks.get(iface)
        if s is None:
            return
        for _ in range(64):
            try:
                data, anc, _f, _src = s.recvmsg(1500, socket.CMSG_SPACE(4))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            hop = None
            for level, kind, value in anc:
                if level == socket.IPPROTO_IPV6 and kind == IPV6_HOPLIMIT and len(value) >= 4:
                    hop = struct.unpack("@i", value[:4])[0]
            if is_router_solicitation(data, hop):
                self._solicited(iface)

    def _solicited(self, iface: str) -> None:
        wait = self._last.get(iface, 0.0) + MIN_RA_GAP - time.monotonic()
        if wait <= 0:
            self._advertise(iface, "solicited")
        elif iface not in self._pending and self._loop is not None:
            self._pending[iface] = self._loop.call_later(wait, self._deferred, iface)

    def _deferred(self, iface: str) -> None:
        self._pending.pop(iface, None)
        self._advertise(iface, "solicited")

    def _advertise(self, iface: str, trigger: str) -> None:
        s = self._socks.get(iface)
        if s is None:
            return
        msg = build_ra(_iface_mac(s, iface), self.prefix)
        try:
            s.sendto(msg, (ALL_NODES, 0, 0, socket.if_nametoindex(iface)))
        except OSError as e:
            log.debug("RA on %s: %s", iface, e)  # e.g. no link-local address yet (DAD)
            return
        self._last[iface] = time.monotonic()
        metrics.ra_sent.labels(trigger).inc()
