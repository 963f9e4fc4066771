"""Boot assets sent by the kernel from worker threads: blocking ``sendfile`` spread over the
cores.

asyncio's own ``loop.sendfile`` runs every transfer on the event loop's thread: one
non-blocking ``sendfile`` per writable wake-up, with the loop's Python (selector, callback,
re-registering the writer) in between. On a 2-core machine that puts all of the kernel's TCP
work for every download on one core, and the loop's Python per chunk on top (bench/BOOT.md,
HTTP boot). Here a transfer of at least ``MIN_BYTES`` is handed to one of ``THREADS`` worker
threads, which sends it in ``SLICE`` bytes per blocking ``sendfile`` (the GIL released
throughout), as nginx's workers do.

Guards:
- A thread is never held by a slow or stalled client: the socket's send timeout is
  ``SLICE_SECONDS`` while a thread sends (a slice that makes no progress for that long
  returns), and a slice slower than ``SLICE_SECONDS`` hands the rest back to the event loop,
  whose non-blocking sendfile waits for such a client at no cost. So is any error but a closed
  connection.
- No queue: when every thread is busy, the transfer runs on the loop as before.
- The thread sends through a duplicate of the socket's descriptor, so a connection closed
  meanwhile cannot make it write to whatever reuses the number; the socket is made blocking
  only while the thread sends (reading is paused and the transport holds nothing, so the
  loop does no I/O on it then) and non-blocking again before the loop sees it.
- Plain TCP transports of asyncio's own loop only: TLS must be encrypted by the transport,
  and other loops keep their own sendfile.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

#: Worker threads at most (``boot.http_sendfile_threads``; 0: every transfer on the loop).
#: Many more than the cores: a sending thread mostly waits for its client, blocked in the
#: kernel, and with too few most downloads of a burst still run on the loop (bench/BOOT.md).
THREADS = 64
#: Smaller transfers (iPXE scripts, signatures, small binaries) stay on the loop: a hand-off
#: costs more than sending them.
MIN_BYTES = 1 << 20
#: Bytes per blocking sendfile call, and the most time one may take before the rest goes back
#: to the loop (a client slower than SLICE / SLICE_SECONDS).
SLICE = 4 << 20
SLICE_SECONDS = 1.0

_pool: ThreadPoolExecutor | None = None
_busy = 0
#: Transfers (and bytes) sent by a thread, and those handed back to the loop part way.
stats = {"threaded": 0, "threaded_bytes": 0, "handed_back": 0}


def configure(threads: int) -> None:
    """Set the most worker threads (the config's ``boot.http_sendfile_threads``)."""
    global THREADS, _pool
    if threads != THREADS and _pool is not None:
        _pool.shutdown(wait=False)
        _pool = None
    THREADS = threads


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="sendfile")
    return _pool


def eligible(loop: asyncio.AbstractEventLoop, transport: Any, count: int) -> bool:
    """Whether a thread may send this transfer now."""
    if count < MIN_BYTES or _busy >= THREADS or transport is None or transport.is_closing():
        return False
    if not isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop):
        return False
    if transport.get_extra_info("sslcontext") is not None:
        return False
    sock = transport.get_extra_info("socket")
    return (
        sock is not None
        and sock.type == socket.SOCK_STREAM
        and transport.get_write_buffer_size() == 0
    )


def _timeval(seconds: float) -> bytes:
    return struct.pack("@ll", int(seconds), int((seconds % 1) * 1e6))


def send_blocking(fd: int, fileno: int, offset: int, count: int) -> int:
    """In a worker thread: send ``count`` bytes of the file ``fileno`` from ``offset`` on the
    socket ``fd`` (duplicates this call owns and closes), blocking, slice by slice; stop early
    (returning what was sent) at a slice slower than SLICE_SECONDS or a send timeout.
    Connection errors raise."""
    sock = socket.socket(fileno=fd)  # closes fd when done, whatever happens
    flags: int | None = None
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(SLICE_SECONDS))
        sent = 0
        while sent < count:
            want = min(SLICE, count - sent)
            t0 = time.monotonic()
            try:
                n = os.sendfile(fd, fileno, offset + sent, want)
            except (BlockingIOError, InterruptedError):
                break  # no progress for SLICE_SECONDS (or a signal): the loop goes on
            if n <= 0:
                break  # the file is shorter than promised: the loop's sendfile says so
            sent += n
            if n < want or time.monotonic() - t0 > SLICE_SECONDS:
                break  # a slow client: the loop waits for it at no cost
        return sent
    finally:
        if flags is not None:
            # Non-blocking again (the flag belongs to the socket, shared with the loop's
            # descriptor) before the loop uses it.
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(0))
        sock.close()
        os.close(fileno)


async def send_threaded(transport: Any, file: Any, offset: int, count: int) -> int:
    """Send up to ``count`` bytes of ``file`` from ``offset`` from a worker thread, reading
    paused meanwhile; returns how many were sent (the caller sends the rest on the loop).
    Cancelled, it shuts the connection down so the thread's send fails at once."""
    global _busy
    loop = asyncio.get_running_loop()
    sock = transport.get_extra_info("socket")
    # Duplicates the thread owns: a connection or file closed meanwhile cannot make it use
    # whatever reuses the numbers.
    fd = os.dup(sock.fileno())
    try:
        src = os.dup(file.fileno())
    except OSError:
        os.close(fd)
        raise
    resume = transport.is_reading()
    transport.pause_reading()
    _busy += 1
    try:
        fut = loop.run_in_executor(_executor(), send_blocking, fd, src, offset, count)
        try:
            sent = await asyncio.shield(fut)
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            transport.abort()
            raise
    finally:
        _busy -= 1
        if resume and not transport.is_closing():
            transport.resume_reading()
    stats["threaded"] += 1
    stats["threaded_bytes"] += sent
    if sent < count:
        stats["handed_back"] += 1
    return sent
