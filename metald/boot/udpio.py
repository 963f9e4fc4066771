"""Batched UDP sends: the datagrams a loop pass produces leave in one ``sendmmsg(2)``.

Sending a reply per ``sendto`` wakes its receiver once per datagram, and on a busy host the
woken receiver preempts the sender at every return from the kernel: a context switch per
reply. One ``sendmmsg`` for all of a pass's replies delivers them together and returns once.
It is called through ctypes (Python's socket module has no sendmmsg); the message headers are
packed into one preallocated buffer, so a datagram costs about what its ``sendto`` did in
Python. Where libc has no sendmmsg (not Linux), each datagram goes out with ``sendto``.

IPv4 only (the DHCP and TFTP shells' sockets). Errors are per datagram: the kernel stops at
the first datagram it cannot send; that one is reported and the rest are sent on, except on
EAGAIN (the socket's send buffer is full), where the rest of the batch is reported too:
nothing is queued beyond what the kernel holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import socket
import struct
from collections.abc import Callable

__all__ = ["SendBatch", "have_sendmmsg"]

#: Datagrams per sendmmsg call at most (the kernel's UIO_MAXIOV is 1024).
MAX_BATCH = 64
#: The largest datagram a batch copies into its buffer; larger ones go out with sendto.
MAX_DATAGRAM = 1500

# struct mmsghdr (x86_64 and aarch64 layouts agree): msghdr {name, namelen, iov, iovlen,
# control, controllen, flags} then msg_len, padded to 64 bytes.
_MMSGHDR = struct.Struct("@PI4xPNPNi4xI4x")
_IOVEC = struct.Struct("@PN")
_SOCKADDR_IN = struct.Struct("=H2s4s8x")  # family (host order), port, address (network order)


def _load_sendmmsg() -> Callable[..., int] | None:
    if _MMSGHDR.size != 64 or _IOVEC.size != 16:  # another ABI: do not guess its layout
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.sendmmsg
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_sendmmsg = _load_sendmmsg()


def have_sendmmsg() -> bool:
    return _sendmmsg is not None


#: (host, port) -> packed sockaddr_in. Bounded: cleared when full.
_ADDRS: dict[tuple[str, int], bytes] = {}
_ADDRS_MAX = 4096


def _sockaddr(dest: tuple[str, int]) -> bytes:
    sa = _ADDRS.get(dest)
    if sa is None:
        if len(_ADDRS) >= _ADDRS_MAX:
            _ADDRS.clear()
        sa = _SOCKADDR_IN.pack(
            socket.AF_INET, dest[1].to_bytes(2, "big"), socket.inet_aton(dest[0])
        )
        _ADDRS[dest] = sa
    return sa


Item = tuple[bytes, tuple[str, int], object]
#: A datagram that was not sent: (its tag, its destination, why).
Failure = tuple[object, tuple[str, int], OSError]


class SendBatch:
    """Datagrams for one socket, queued with ``add`` and sent by ``flush``, which returns
    those that were not sent with the ``tag`` each was added with."""

    def __init__(self, sock: socket.socket, *, use_sendmmsg: bool = True) -> None:
        self.sock = sock
        self.pending: list[Item] = []
        # Anything but a real socket (a test's stand-in) gets its own sendto called.
        self._mmsg = use_sendmmsg and _sendmmsg is not None and isinstance(sock, socket.socket)
        self._buf: ctypes.Array[ctypes.c_char] | None = None  # allocated on first use

    def add(self, data: bytes, dest: tuple[str, int], tag: object = None) -> None:
        self.pending.append((data, dest, tag))

    def flush(self) -> list[Failure]:
        """Send what is queued; return the datagrams the kernel did not take."""
        if not self.pending:
            return []
        batch, self.pending = self.pending, []
        failed: list[Failure] = []
        if not self._mmsg or self.sock.fileno() < 0:
            self._sendto_each(batch, failed)
            return failed
        if self._buf is None:
            per = _MMSGHDR.size + _IOVEC.size + 16 + MAX_DATAGRAM
            self._buf = ctypes.create_string_buffer(MAX_BATCH * per)
            self._base = ctypes.addressof(self._buf)
            self._view = memoryview(self._buf).cast("B")
        for i in range(0, len(batch), MAX_BATCH):
            self._send_chunk(batch[i : i + MAX_BATCH], failed)
        return failed

    def _sendto_each(self, batch: list[Item], failed: list[Failure]) -> None:
        for k, (data, dest, tag) in enumerate(batch):
            try:
                self.sock.sendto(data, dest)
            except (BlockingIOError, InterruptedError) as e:
                failed.extend((t, d, e) for _, d, t in batch[k:])
                return
            except OSError as e:
                failed.append((tag, dest, e))

    def _send_chunk(self, items: list[Item], failed: list[Failure]) -> None:
        assert _sendmmsg is not None
        base, view = self._base, self._view
        hdr_pack, iov_pack = _MMSGHDR.pack_into, _IOVEC.pack_into
        batch: list[Item] = []
        addrs: list[bytes] = []
        for item in items:
            if len(item[0]) > MAX_DATAGRAM:
                return self._sendto_each(items, failed)  # rare (no DHCP reply is)
            try:
                addrs.append(_sockaddr(item[1]))
            except (OSError, ValueError, OverflowError, TypeError) as e:  # not IPv4
                failed.append((item[2], item[1], e if isinstance(e, OSError) else OSError(str(e))))
                continue
            batch.append(item)
        n = len(batch)
        iov_at = n * 64
        sa_at = iov_at + n * 16
        data_at = sa_at + n * 16
        for k in range(n):
            data = batch[k][0]
            size = len(data)
            iov = iov_at + k * 16
            sa = sa_at + k * 16
            hdr_pack(view, k * 64, base + sa, 16, base + iov, 1, 0, 0, 0, 0)
            iov_pack(view, iov, base + data_at, size)
            view[sa : sa + 16] = addrs[k]
            view[data_at : data_at + size] = data
            data_at += size
        k, fd = 0, self.sock.fileno()
        while k < n:
            r = _sendmmsg(fd, base + k * 64, n - k, 0)
            if r > 0:
                k += r
                continue
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                e = BlockingIOError(err, os.strerror(err))
                failed.extend((t, d, e) for _, d, t in batch[k:])
                return
            # This one failed (the kernel stops at it); the rest may still go.
            failed.append((batch[k][2], batch[k][1], OSError(err, os.strerror(err))))
            k += 1
