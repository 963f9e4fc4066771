"""Which event loop runs metald: asyncio's own (the default) or uvloop (opt-in).

The config's top-level ``event_loop`` ("asyncio" or "uvloop"; also ``METALD_EVENT_LOOP=uvloop``
through the usual environment override) chooses; the benchmarks compare the two in one run
with it. uvloop is not the default: measured side by side (bench/BOOT.md) it saved a few per
cent of CPU on DHCP and TFTP windowed transfers at best, cost more in TFTP lock-step on some
runs, and cost ~35 % more CPU serving boot assets over HTTP even with the kernel sendfile
below (without it, aiohttp reads every asset through a thread).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

CHOICES = ("asyncio", "uvloop")


def loop_factory(choice: str = "asyncio") -> tuple[str, Any]:
    """(name, factory) for ``choice``. ImportError for "uvloop" without the package."""
    want = choice.strip().lower()
    if want not in CHOICES:
        raise ValueError(f"event_loop {want!r}: expected one of {', '.join(CHOICES)}")
    if want == "uvloop":
        return "uvloop", _uvloop_class()
    return "asyncio", asyncio.new_event_loop


def _uvloop_class() -> type[asyncio.AbstractEventLoop]:
    import uvloop
    import uvloop.loop

    plain = (uvloop.loop.TCPTransport, uvloop.loop.UnixTransport)

    class Loop(uvloop.Loop):  # type: ignore[misc, name-defined]
        """uvloop with ``loop.sendfile`` done by the kernel, as asyncio's own loop does.

        uvloop leaves ``sendfile`` to asyncio's default, which raises NotImplementedError,
        so aiohttp's FileResponse falls back to reading the file in a thread and writing
        it through the transport: two copies more per byte of every boot asset.
        """

        async def sendfile(
            self,
            transport: asyncio.BaseTransport,
            file: Any,
            offset: int = 0,
            count: int | None = None,
            *,
            fallback: bool = True,
        ) -> int:
            if type(transport) not in plain or transport.is_closing():
                # TLS (the bytes must be encrypted) or anything unusual: the caller's
                # fallback writes through the transport.
                raise NotImplementedError("sendfile: not a plain uvloop socket transport")
            return await sendfile_native(self, transport, file, offset, count)

    return Loop


class _Writable:
    """Writability of a descriptor as awaitable wake-ups; registered once for a whole
    transfer (adding and removing a uvloop poll handle per wait costs two epoll_ctl calls and
    a handle each time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self.loop, self.fd = loop, fd
        self._fut: asyncio.Future[None] | None = None
        self._registered = False

    def _ready(self) -> None:
        fut = self._fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def wait(self) -> None:
        if not self._registered:
            self.loop.add_writer(self.fd, self._ready)
            self._registered = True
        self._fut = self.loop.create_future()
        try:
            await self._fut
        finally:
            self._fut = None

    def close(self) -> None:
        if self._registered:
            self.loop.remove_writer(self.fd)
            self._registered = False


async def sendfile_native(
    loop: asyncio.AbstractEventLoop,
    transport: Any,
    file: Any,
    offset: int,
    count: int | None,
) -> int:
    """Send ``count`` bytes of ``file`` from ``offset`` with os.sendfile on the transport's
    socket, after what the transport already holds (the response headers), reading paused
    meanwhile. The wait for writability is on a duplicate of the socket's descriptor: uvloop
    refuses readers and writers on a descriptor one of its transports owns. Returns the bytes
    sent; leaves the file position after them, like ``loop.sendfile``."""
    sock = transport.get_extra_info("socket")
    fileno = file.fileno()
    if count is None:
        count = os.fstat(fileno).st_size - offset
    fd = os.dup(sock.fileno())
    writable = _Writable(loop, fd)
    transport.pause_reading()
    sent = 0
    try:
        # What the transport holds goes first (libuv writes it when the socket is writable).
        while transport.get_write_buffer_size():
            await writable.wait()
            await asyncio.sleep(0)
        while sent < count:
            if transport.is_closing():
                raise ConnectionResetError("the connection closed during sendfile")
            try:
                n = os.sendfile(fd, fileno, offset + sent, count - sent)
            except (BlockingIOError, InterruptedError):
                await writable.wait()
                continue
            if n == 0:  # the file is shorter than promised
                break
            sent += n
        return sent
    finally:
        writable.close()
        os.close(fd)
        if sent:
            file.seek(offset + sent)
        if not transport.is_closing():
            transport.resume_reading()


def run(main: Coroutine[Any, Any, T], choice: str = "asyncio") -> T:
    """``asyncio.run`` on the chosen loop."""
    _name, factory = loop_factory(choice)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
