"""TFTP server's asyncio shell: a listener per interface, one ephemeral socket per transfer.

Why not tftpy: its server runs one thread with select() over all transfers and logs per packet;
LAB-NOTES measured it at 2.66 s for 200 concurrent ipxe.efi fetches against dnsmasq's 1.30 s.
Here a transfer is the pure ``ReadTransfer`` machine plus a socket and a timer; contents come
from ``FileCache`` (one shared copy of a small file, pread for big ones); which transfers are
held is decided by the pure ``TransferTable`` (per-client and global caps, unconfirmed
transfers evicted first), so spoofed requests cannot lock real clients out or run the process
out of descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import select
import socket
from collections.abc import Callable
from pathlib import Path
from time import monotonic
from typing import Any

from metald.boot import metrics
from metald.boot.netutil import SO_BINDTODEVICE, udp_socket
from metald.boot.paths import PathRefused, safe_path
from metald.boot.tftp.admission import TransferTable
from metald.boot.tftp.packet import (
    ErrorCode,
    MalformedTftp,
    Opcode,
    Request,
    error_packet,
    negotiate,
    parse_request,
)
from metald.boot.tftp.source import FileCache, SourceRefused
from metald.boot.tftp.transfer import RUNNING, ReadTransfer

log = logging.getLogger(__name__)


def _fast_drain() -> Callable[..., tuple[int, int, int, bytes | None, bool]] | None:
    """The C lock-step ACK loop (``_fastack.c``, built by setup.py when a compiler is there),
    or None: then the pure-Python path."""
    try:
        from metald.boot.tftp._fastack import drain
    except ImportError:
        return None
    return drain


def _fast_ready() -> tuple[Callable[..., list[tuple[_Transfer, bytes | None, bool]]], type] | None:
    """The C hub loop (``_fastack.ready``) and its per-transfer state (``_fastack.Lane``),
    or None."""
    try:
        from metald.boot.tftp._fastack import Lane, ready
    except ImportError:
        return None
    return ready, Lane


#: Chosen at import; ``TftpServer(fast_ack=False)`` (config ``boot.tftp_fast_ack = false``,
#: or ``METALD_BOOT__TFTP_FAST_ACK=false``) uses the Python path whatever this is.
FAST_DRAIN = _fast_drain()
FAST_READY = _fast_ready()

IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)
#: Datagrams the hub's C loop reads per ready socket per wake-up. One: in lock-step a socket
#: holds one ACK at a time, so a second recv would fail with EAGAIN (a syscall per ACK for
#: nothing); the epoll set is level-triggered, so anything still queued is reported again by
#: the next wake-up. (bench/BOOT.md: 64 against 1.)
HUB_READS = 1
#: Descriptors left for everything else in the process (API, database, DHCP) when the
#: transfer cap is fitted under RLIMIT_NOFILE: each transfer holds one socket.
FD_RESERVE = 256


class _Hub:
    """All transfer sockets of a server in one epoll set, one reader on the event loop.

    With one ``add_reader`` per transfer socket, each ready socket costs the loop a selector
    key, a handle and a callback per wake-up: with 200 lock-step clients, what was left of
    metald's user time against dnsmasq. Here the loop wakes for the hub's epoll descriptor and
    the C loop (``_fastack.ready``) serves every ready socket at once. Each transfer has a
    ``Lane`` (C): while the transfer is confirmed, running, windowsize 1 with shared packets,
    its lane is armed with the transfer's state and C answers in-order ACKs from it, exactly
    as ``_Transfer._readable``'s C drain answers them, without reading a Python attribute;
    the transfer takes back what C advanced (``_Transfer._sync``) before Python touches it.
    Whatever C may not answer (a disarmed lane, the last ACK, any other datagram, a failed
    send) comes back and goes through ``_Transfer._readable`` as before. The epoll set is
    level-triggered, as the loop's own selector: a socket left with datagrams (``HUB_READS``
    per wake-up) is reported again on the next wake-up.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        ready: Callable[..., list[tuple[_Transfer, bytes | None, bool]]],
        lane: type | None = None,
    ) -> None:
        self.loop = loop
        self.ready = ready
        #: The lane type; a test's stand-in ``ready`` may run without one.
        self.lane = lane
        self.ep = select.epoll()
        #: Transfer socket descriptor -> its lane (the C loop looks them up here).
        self.lanes: dict[int, Any] = {}
        loop.add_reader(self.ep.fileno(), self._wake)

    def add(self, t: _Transfer) -> Any:
        """Watch ``t``'s socket; its lane (disarmed until the transfer arms it)."""
        fd = t.sock.fileno()
        lane = self.lane(t) if self.lane is not None else None
        self.ep.register(fd, select.EPOLLIN)
        self.lanes[fd] = lane
        return lane

    def remove(self, t: _Transfer) -> None:
        fd = t.sock.fileno()
        if fd in self.lanes:
            lane = self.lanes.pop(fd)
            if lane is not None:
                lane.disarm()
            self.ep.unregister(fd)

    def _wake(self) -> None:
        todo = self.ready(self.ep.fileno(), self.lanes, monotonic(), HUB_READS)
        for t, data, failed in todo:
            if t.closed:
                continue
            t._sync()
            if failed:  # sent once in C; the Python path's retries, as for its own send
                m = t.machine
                if m._packets is not None:
                    t._send([m._packets[m.sent - 1]])
            t._readable(data)

    def close(self) -> None:
        self.loop.remove_reader(self.ep.fileno())
        self.ep.close()
        for lane in self.lanes.values():
            if lane is not None:
                lane.disarm()
        self.lanes.clear()


class _Transfer:
    """One transfer's socket and timer around its ``ReadTransfer``.

    A plain non-blocking socket with add_reader, and one timer per transfer that checks for
    silence, instead of a transport plus a cancelled-and-rearmed timer per packet: per-packet
    overhead is what bounds a Python TFTP server with 200 clients (about 119,000 DATA and as
    many ACKs for 200 copies of ipxe.efi at blksize 1428).

    The socket is connected to the client's address and port (its TID): send and recv, no
    address to build or compare per packet, and a packet from any other address or port
    never reaches metald (the kernel answers it with a rate-limited ICMP port unreachable,
    where RFC 1350 suggests an ERROR packet; tftpd-hpa and atftpd connect too). So a flood
    at a transfer's port from elsewhere costs metald nothing.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        machine: ReadTransfer,
        peer: tuple[str, int],
        request: Request,
        on_event: Callable[[_Transfer, str], None],
        fast_drain: Callable[..., tuple[int, int, int, bytes | None, bool]] | None = FAST_DRAIN,
        hub: _Hub | None = None,
    ) -> None:
        self.loop = loop
        #: The server's lock-step hub this socket is watched by, or None: its own reader.
        self.hub = hub
        self.fast_drain = fast_drain
        self.sock = sock  # bound, non-blocking, connected to ``peer``
        self.machine = machine
        self.peer = peer
        self.request = request
        self.on_event = on_event
        self.confirmed = False
        self.closed = False
        #: When the transfer last sent (time.monotonic, the clock asyncio's loop uses).
        self.last = monotonic()
        self.timer: asyncio.TimerHandle | None = None
        #: This transfer's state in the hub's C loop (``_fastack.Lane``), or None.
        self.lane: Any = None

    def start(self) -> None:
        if self.hub is not None:
            self.lane = self.hub.add(self)
        else:
            self.loop.add_reader(self.sock.fileno(), self._readable)
        self._send(self.machine.start())
        self.timer = self.loop.call_later(self.machine.interval, self._check)

    def _readable(self, first: bytes | None = None) -> None:
        # Drained until EAGAIN, 64 datagrams at most per wake-up. In lock-step the client
        # often answers while the server is still in send (it is woken and runs; 200 fetches
        # on loopback: 119,400 ACKs in 17,000-43,000 calls here), so those ACKs are read
        # without a trip through the event loop; one datagram per wake-up cost 30 % more CPU.
        #
        # With the C loop (FAST_DRAIN), a lock-step transfer's in-order ACKs are read and
        # answered there, the same way ``on_packet``'s inline path answers them; it returns
        # the first datagram it does not handle, which is handled here as before, and the
        # 64-datagram bound counts both. ``first``: a datagram the hub's C loop read and did
        # not handle, handled before anything else is read.
        if self.closed:
            return
        self._sync()
        recv, send, machine, fast = self.sock.recv, self.sock.send, self.machine, self.fast_drain
        sent = False
        left = 64
        while left > 0:
            packets = machine.lockstep_packets() if fast is not None else None
            if first is not None:
                data, first = first, None
            elif packets is not None:
                handled, acked, last, data, failed = fast(  # type: ignore[misc]
                    self.sock.fileno(), packets, machine.acked, machine.sent, machine.nblocks, left
                )
                if handled:
                    machine.lockstep_advanced(acked, last)
                    sent = True
                    left -= handled
                    if failed:  # sent once; the Python path's retries, as for its own send
                        self._send([packets[last - 1]])
                        continue
                if data is None:
                    break
            else:
                try:
                    data = recv(2048)
                except OSError:  # EAGAIN: drained; or a queued ICMP error, reported once
                    break
            left -= 1
            try:
                out = machine.on_packet(data)
            except MalformedTftp as e:
                metrics.inc(metrics.tftp_dropped, e.reason)
                continue
            if out:
                sent = True
                try:
                    for p in out:
                        send(p)
                except OSError:
                    self._send(out[out.index(p) :])
            if machine.result is not RUNNING:
                self.end(machine.result.value)
                return
        if sent:
            self.last = monotonic()
        if machine.confirmed and not self.confirmed:
            self.confirmed = True
            self.on_event(self, "confirmed")
        if self.lane is not None and not self.closed:
            self._arm()

    def _sync(self) -> None:
        """Take back what the hub's C loop advanced (in-order ACKs it answered): the same
        state change as ``on_packet``'s inline path, and when it last sent."""
        lane = self.lane
        if lane is not None:
            got = lane.take()
            if got is not None:
                acked, sent, last = got
                self.machine.lockstep_advanced(acked, sent)
                if last > self.last:
                    self.last = last

    def _arm(self) -> None:
        """Let the hub's C loop answer this transfer's ACKs from its current state while it
        is confirmed (its "confirmed" event has gone out) and running in lock-step with
        shared packets (``ReadTransfer.lockstep_packets``); else Python reads every
        datagram."""
        m = self.machine
        packets = m.lockstep_packets() if self.confirmed else None
        if packets is not None:
            self.lane.arm(packets, m.acked, m.sent, m.nblocks)
        else:
            self.lane.disarm()

    def repeated_request(self) -> None:
        self._sync()
        out = self.machine.on_repeated_request()
        if out:
            self.last = monotonic()
            self._send(out)

    def _check(self) -> None:
        if self.closed:
            return
        self._sync()
        interval = self.machine.interval
        idle = monotonic() - self.last
        if idle >= interval:
            self._send(self.machine.on_timeout())
            self.last = monotonic()
            if self.machine.done:
                self.end(self.machine.result.value)
                return
            if self.lane is not None:
                self._arm()
            idle = 0.0
        self.timer = self.loop.call_later(interval - idle, self._check)

    def _send(self, packets: list[bytes]) -> None:
        """Send in order; stop at the first that cannot go (the retransmit timer resends)."""
        send = self.sock.send
        for p in packets:
            try:
                send(p)
            except OSError:
                # A full socket buffer, or an ICMP error queued on the connected socket (the
                # client's port closed, or a forged ICMP), which fails one call and is then
                # cleared: so one more try, lest a forged ICMP cost a timeout.
                try:
                    send(p)
                except OSError:
                    return

    def end(self, result: str) -> None:
        """Close and report once: "ok", "timeout", "evicted-unconfirmed", ..."""
        if self.closed:
            return
        self.close()
        self.on_event(self, result)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            if self.hub is not None:
                self.hub.remove(self)
                self.lane = None  # it refers to this transfer: no cycle left behind
            else:
                self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        self.machine.close()


class TftpServer:
    name = "tftp"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        interfaces: list[str] | None = None,
        host: str = "0.0.0.0",
        port: int = 69,
        max_transfers: int = 512,
        max_per_client: int = 8,
        timeout: float = 1.0,
        cache: FileCache | None = None,
        fast_ack: bool = True,
        hub: bool = True,
    ) -> None:
        self.root = Path(root).resolve()
        self.interfaces = interfaces or []
        self.host = host
        self.port = port
        self.max_transfers = max_transfers
        self.max_per_client = max_per_client
        self.timeout = timeout
        self.cache = cache or FileCache()
        #: The C lock-step loop, unless it is not built or turned off (tests, benches).
        self.fast_drain = FAST_DRAIN if fast_ack else None
        self.table: TransferTable[_Transfer] = TransferTable(max_transfers, max_per_client)
        #: The latest transfer per client (address, port), to recognise a repeated RRQ.
        self._by_peer: dict[tuple[str, int], _Transfer] = {}
        self._socks: list[tuple[socket.socket, str]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        #: One epoll set for every transfer socket, served in C (_Hub); with the C loop only.
        #: ``hub=False``: a reader per transfer socket (benches compare the two).
        self.use_hub = hub
        self._hub: _Hub | None = None

    @property
    def bound_port(self) -> int:
        return self._socks[0][0].getsockname()[1] if self._socks else self.port

    @property
    def transfers(self) -> int:
        return len(self.table)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._fit_fd_limit()
        try:
            if self.use_hub and self.fast_drain is not None and FAST_READY is not None:
                self._hub = _Hub(self._loop, *FAST_READY)
            for iface in self.interfaces or [""]:
                s = udp_socket(self.host, self.port, interface=iface)
                s.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
                self._socks.append((s, iface))
                self._loop.add_reader(s.fileno(), self._readable, s, iface)
        except BaseException:
            await self.stop()
            raise
        log.info(
            "TFTP on %s port %d, root %s; lock-step ACKs in %s",
            self.interfaces or self.host,
            self.port,
            self.root,
            "C" if self.fast_drain is not None else "Python",
        )

    def _fit_fd_limit(self) -> None:
        """Each transfer holds a socket: keep the cap under the descriptor limit, so a flood
        of requests cannot take descriptors from the API and the database."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return
        fit = max(1, (soft - FD_RESERVE) // 2)
        if self.max_transfers > fit:
            log.warning(
                "TFTP: at most %d concurrent transfers (not %d): RLIMIT_NOFILE is %d; "
                "raise LimitNOFILE to allow more",
                fit,
                self.max_transfers,
                soft,
            )
            self.max_transfers = fit
            self.table.max_total = fit

    async def stop(self) -> None:
        for s, _ in self._socks:
            if self._loop is not None:
                self._loop.remove_reader(s.fileno())
            s.close()
        self._socks.clear()
        for t in list(self.table):
            t.end("stopped")
        if self._hub is not None:
            self._hub.close()
            self._hub = None

    def _readable(self, sock: socket.socket, iface: str) -> None:
        for _ in range(256):
            try:
                data, anc, _flags, peer = sock.recvmsg(2048, socket.CMSG_SPACE(12))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("TFTP receive: %s", e)
                return
            local = self.host
            for level, kind, value in anc:
                if level == socket.IPPROTO_IP and kind == IP_PKTINFO and len(value) >= 12:
                    local = socket.inet_ntoa(value[8:12])  # ipi_addr: where it was sent to
            self._request(sock, data, peer, local, iface)

    def _request(
        self, sock: socket.socket, data: bytes, peer: tuple[str, int], local: str, iface: str
    ) -> None:
        try:
            req = parse_request(data)
        except MalformedTftp as e:
            metrics.inc(metrics.tftp_dropped, e.reason)
            if e.reason == "not-a-request":
                return  # stray ACK/DATA to port 69: no answer, it is not ours
            self._reply_error(sock, peer, ErrorCode.ILLEGAL_OPERATION, "malformed request")
            return
        if req.opcode == Opcode.WRQ:
            metrics.inc(metrics.tftp_transfers, "refused-write")
            self._reply_error(sock, peer, ErrorCode.ACCESS_VIOLATION, "read-only server")
            return
        prev = self._by_peer.get(peer)
        if prev is not None and not prev.confirmed and prev.request == req:
            # The client repeats its request: our first packet was lost (or it is a replay).
            metrics.inc(metrics.tftp_dropped, "repeated-request")
            prev.repeated_request()
            return
        try:
            path = safe_path(self.root, req.filename)
            source = self.cache.open(path, req.mode)
        except PathRefused as e:
            metrics.inc(metrics.tftp_transfers, f"refused-{e.reason}")
            code = ErrorCode.NOT_FOUND if e.reason == "not-found" else ErrorCode.ACCESS_VIOLATION
            self._reply_error(
                sock,
                peer,
                code,
                "file not found" if e.reason == "not-found" else "access violation",
            )
            return
        except SourceRefused as e:
            metrics.inc(metrics.tftp_transfers, f"refused-{e.reason}")
            self._reply_error(sock, peer, ErrorCode.ILLEGAL_OPERATION, e.message)
            return
        except OSError:
            metrics.inc(metrics.tftp_transfers, "refused-unreadable")
            self._reply_error(sock, peer, ErrorCode.ACCESS_VIOLATION, "unreadable")
            return
        neg = negotiate(req.options, source.size, default_timeout=self.timeout)
        machine = ReadTransfer(source, neg, name=req.filename)
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        except OSError:
            machine.close()
            metrics.inc(metrics.tftp_transfers, "socket-error")
            return
        try:
            if iface:
                s.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, iface.encode())
            s.setblocking(False)
            s.bind((local, 0))
            s.connect(peer)
        except OSError:
            s.close()
            machine.close()
            metrics.inc(metrics.tftp_transfers, "socket-error")
            return
        assert self._loop is not None
        t = _Transfer(
            self._loop, s, machine, peer, req, self._transfer_event, self.fast_drain, self._hub
        )
        adm = self.table.admit(t, peer[0], self._loop.time())
        if not adm.admitted:
            t.close()
            metrics.inc(metrics.tftp_transfers, adm.reason)
            if adm.reason == "refused-per-client":
                self._reply_error(
                    sock,
                    peer,
                    ErrorCode.UNDEFINED,
                    f"too many transfers from {peer[0]} (at most {self.max_per_client})",
                )
            # Globally busy: no answer, so the client's own retransmission retries later.
            return
        for victim, why in adm.evicted:
            victim.end(why)
        self._by_peer[peer] = t
        t.start()

    def _transfer_event(self, t: _Transfer, event: str) -> None:
        if event == "confirmed":
            self.table.confirm(t)
            return
        self.table.remove(t)
        if self._by_peer.get(t.peer) is t:
            del self._by_peer[t.peer]
        metrics.inc(metrics.tftp_transfers, event)
        # Unconfirmed transfers may be spoofed: logging each would let a flood fill the log.
        log.log(
            logging.INFO if t.confirmed else logging.DEBUG,
            "TFTP %s to %s: %s",
            t.machine.name,
            t.peer[0],
            event,
        )

    def _reply_error(
        self, sock: socket.socket, peer: tuple[str, int], code: ErrorCode, msg: str
    ) -> None:
        with contextlib.suppress(OSError):
            sock.sendto(error_packet(code, msg), peer)
