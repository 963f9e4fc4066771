"""TFTP server's asyncio shell: a listener per interface, one ephemeral socket per transfer.

Why not tftpy: its server runs one thread with select() over all transfers and logs per packet;
LAB-NOTES measured it at 2.66 s for 200 concurrent ipxe.efi fetches against dnsmasq's 1.30 s.
Here a transfer is the pure ``ReadTransfer`` machine plus a socket and a timer, and file
contents are cached, so 200 clients read one copy of ipxe.efi.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from pathlib import Path

from metald.boot import metrics
from metald.boot.netutil import SO_BINDTODEVICE, udp_socket
from metald.boot.paths import PathRefused, safe_path
from metald.boot.tftp.packet import (
    ErrorCode,
    MalformedTftp,
    Opcode,
    error_packet,
    negotiate,
    parse_request,
    to_netascii,
)
from metald.boot.tftp.transfer import ReadTransfer, Result

log = logging.getLogger(__name__)

IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)
#: Files at most this big are kept in memory between transfers.
CACHE_FILE_MAX = 64 << 20
CACHE_TOTAL_MAX = 256 << 20


class FileCache:
    """Whole-file contents keyed by path, revalidated by (mtime, size) on every open."""

    def __init__(self) -> None:
        self._files: dict[Path, tuple[int, int, bytes]] = {}
        self._total = 0

    def read(self, path: Path) -> bytes:
        st = path.stat()
        hit = self._files.get(path)
        if hit is not None and hit[0] == st.st_mtime_ns and hit[1] == st.st_size:
            return hit[2]
        data = path.read_bytes()
        if len(data) <= CACHE_FILE_MAX:
            if hit is not None:
                self._total -= len(hit[2])
            while self._files and self._total + len(data) > CACHE_TOTAL_MAX:
                _, (_, _, old) = self._files.popitem()
                self._total -= len(old)
            self._files[path] = (st.st_mtime_ns, st.st_size, data)
            self._total += len(data)
        return data


class _Transfer:
    """One transfer's socket and timer around its ``ReadTransfer``.

    A plain non-blocking socket with add_reader, and one timer per transfer that checks for
    silence, instead of a transport plus a cancelled-and-rearmed timer per packet: per-packet
    overhead is what bounds a Python TFTP server with 200 clients (about 146,000 DATA and as
    many ACKs for 200 copies of ipxe.efi).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        machine: ReadTransfer,
        peer: tuple[str, int],
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.machine = machine
        self.peer = peer
        self.timeout = machine.neg.timeout
        self.finished: asyncio.Future[Result] = loop.create_future()
        self.last = loop.time()
        loop.add_reader(sock.fileno(), self._readable)
        self._send(machine.start())
        self.timer = loop.call_later(self.timeout, self._check)

    def _readable(self) -> None:
        sock, machine = self.sock, self.machine
        while True:
            try:
                data, addr = sock.recvfrom(2048)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # ICMP port unreachable: the client went away
                return
            if addr != self.peer:
                # RFC 1350: a packet from another TID gets an error; the transfer goes on.
                metrics.inc(metrics.tftp_dropped, "unknown-tid")
                self._sendto(error_packet(ErrorCode.UNKNOWN_TID, "unknown transfer id"), addr)
                continue
            try:
                out = machine.on_packet(data)
            except MalformedTftp as e:
                metrics.inc(metrics.tftp_dropped, e.reason)
                continue
            if out:
                self.last = self.loop.time()
                self._send(out)
            if machine.done:
                self._finish()
                return

    def _check(self) -> None:
        if self.finished.done():
            return
        idle = self.loop.time() - self.last
        if idle >= self.timeout:
            self._send(self.machine.on_timeout())
            self.last = self.loop.time()
            if self.machine.done:
                self._finish()
                return
            idle = 0.0
        self.timer = self.loop.call_later(self.timeout - idle, self._check)

    def _send(self, packets: list[bytes]) -> None:
        for p in packets:
            self._sendto(p, self.peer)

    def _sendto(self, packet: bytes, addr: tuple[str, int]) -> None:
        try:
            self.sock.sendto(packet, addr)
        except (BlockingIOError, InterruptedError):
            pass  # the socket buffer is full: the retransmit timer will resend
        except OSError:
            pass

    def _finish(self) -> None:
        if not self.finished.done():
            self.finished.set_result(self.machine.result)
        self.close()

    def close(self) -> None:
        self.timer.cancel()
        if self.sock.fileno() >= 0:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()


class TftpServer:
    name = "tftp"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        interfaces: list[str] | None = None,
        host: str = "0.0.0.0",
        port: int = 69,
        max_transfers: int = 2048,
        timeout: float = 1.0,
    ) -> None:
        self.root = Path(root).resolve()
        self.interfaces = interfaces or []
        self.host = host
        self.port = port
        self.max_transfers = max_transfers
        self.timeout = timeout
        self.cache = FileCache()
        self._socks: list[tuple[socket.socket, str]] = []
        self._transfers: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def bound_port(self) -> int:
        return self._socks[0][0].getsockname()[1] if self._socks else self.port

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            for iface in self.interfaces or [""]:
                s = udp_socket(self.host, self.port, interface=iface)
                s.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
                self._socks.append((s, iface))
                self._loop.add_reader(s.fileno(), self._readable, s, iface)
        except BaseException:
            await self.stop()
            raise
        log.info("TFTP on %s port %d, root %s", self.interfaces or self.host, self.port, self.root)

    async def stop(self) -> None:
        for s, _ in self._socks:
            if self._loop is not None:
                self._loop.remove_reader(s.fileno())
            s.close()
        self._socks.clear()
        for t in list(self._transfers):
            t.cancel()
        if self._transfers:
            await asyncio.gather(*self._transfers, return_exceptions=True)

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
        if len(self._transfers) >= self.max_transfers:
            metrics.inc(metrics.tftp_transfers, "busy")
            self._reply_error(sock, peer, ErrorCode.UNDEFINED, "server busy, retry")
            return
        try:
            path = safe_path(self.root, req.filename)
            content = self.cache.read(path)
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
        except OSError:
            metrics.inc(metrics.tftp_transfers, "refused-unreadable")
            self._reply_error(sock, peer, ErrorCode.ACCESS_VIOLATION, "unreadable")
            return
        if req.mode == "netascii":
            content = to_netascii(content)
        neg = negotiate(req.options, len(content), default_timeout=self.timeout)
        assert self._loop is not None
        task = self._loop.create_task(
            self._serve(ReadTransfer(content, neg, name=req.filename), peer, local, iface)
        )
        self._transfers.add(task)
        task.add_done_callback(self._transfers.discard)

    async def _serve(
        self, machine: ReadTransfer, peer: tuple[str, int], local: str, iface: str
    ) -> None:
        assert self._loop is not None
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            if iface:
                s.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, iface.encode())
            s.setblocking(False)
            s.bind((local, 0))
        except OSError:
            s.close()
            metrics.inc(metrics.tftp_transfers, "socket-error")
            return
        t = _Transfer(self._loop, s, machine, peer)
        try:
            result = await t.finished
        finally:
            t.close()
        metrics.inc(metrics.tftp_transfers, result.value)
        log.info("TFTP %s to %s: %s", machine.name, peer[0], result.value)

    def _reply_error(
        self, sock: socket.socket, peer: tuple[str, int], code: ErrorCode, msg: str
    ) -> None:
        with contextlib.suppress(OSError):
            sock.sendto(error_packet(code, msg), peer)
