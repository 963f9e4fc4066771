"""Which asyncio event loop runs metald: uvloop when installed, the standard one otherwise.

The config's top-level ``event_loop`` ("auto", "uvloop", "asyncio"; also
``METALD_EVENT_LOOP=asyncio`` through the usual environment override) chooses: benchmarks
compare the two in one run with it, and it is the fallback should uvloop misbehave on a host.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

CHOICES = ("auto", "uvloop", "asyncio")


def loop_factory(choice: str = "auto") -> tuple[str, Any]:
    """(name, factory) for ``choice``; "auto" falls back to asyncio without uvloop."""
    want = choice.strip().lower()
    if want not in CHOICES:
        raise ValueError(f"event_loop {want!r}: expected one of {', '.join(CHOICES)}")
    if want in ("auto", "uvloop"):
        try:
            cls = _uvloop_class()
        except ImportError:
            if want == "uvloop":
                raise
        else:
            return "uvloop", cls
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


async def _writable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    fut = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_writer(fd, ready)
    try:
        await fut
    finally:
        loop.remove_writer(fd)


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
    transport.pause_reading()
    sent = 0
    try:
        # What the transport holds goes first (libuv writes it when the socket is writable).
        while transport.get_write_buffer_size():
            await _writable(loop, fd)
            await asyncio.sleep(0)
        while sent < count:
            if transport.is_closing():
                raise ConnectionResetError("the connection closed during sendfile")
            try:
                n = os.sendfile(fd, fileno, offset + sent, count - sent)
            except (BlockingIOError, InterruptedError):
                await _writable(loop, fd)
                continue
            if n == 0:  # the file is shorter than promised
                break
            sent += n
        return sent
    finally:
        os.close(fd)
        if sent:
            file.seek(offset + sent)
        if not transport.is_closing():
            transport.resume_reading()


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """``asyncio.run`` on the chosen loop."""
    _name, factory = loop_factory(choice)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
