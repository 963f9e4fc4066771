"""A small asyncio client for the QEMU Machine Protocol (QMP) over a unix socket.

One reader task takes every message off the socket: command replies go to the command that
waits for them (commands are sent one at a time), events go to every open subscription.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any


class QmpError(Exception):
    """QEMU answered a command with an error, or the connection broke."""


class EventStream:
    """Events QEMU sends while the subscription is open."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=1000)

    def _put(self, event: dict[str, Any]) -> None:
        if self.queue.full():
            self.queue.get_nowait()  # a slow reader loses the oldest events, not the newest
        self.queue.put_nowait(event)

    async def wait(self, name: str, timeout: float | None = 10.0, **data: Any) -> dict[str, Any]:
        """The next event called ``name`` whose data holds ``data``; others are skipped."""
        async with asyncio.timeout(timeout):
            while True:
                event = await self.queue.get()
                got = event.get("data", {})
                if event.get("event") == name and all(got.get(k) == v for k, v in data.items()):
                    return event


class QmpClient:
    def __init__(self, path: str) -> None:
        self.path = path
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: asyncio.Future[dict[str, Any]] | None = None
        self._command_lock = asyncio.Lock()
        self._streams: set[EventStream] = set()

    async def connect(self, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            reader, self._writer = await asyncio.open_unix_connection(self.path, limit=1 << 22)
            greeting = json.loads(await reader.readline() or b"{}")
            if "QMP" not in greeting:
                raise QmpError(f"not a QMP greeting: {greeting!r}")
            self._reader_task = asyncio.create_task(self._read_loop(reader))
            # QMP accepts commands only after capabilities negotiation.
            await self.execute("qmp_capabilities")

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
            self._reader_task = None
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await self._writer.wait_closed()
            self._writer = None

    async def __aenter__(self) -> QmpClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        return self._reader_task is not None and not self._reader_task.done()

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[EventStream]:
        """Events from now until the ``with`` block ends."""
        stream = EventStream()
        self._streams.add(stream)
        try:
            yield stream
        finally:
            self._streams.discard(stream)

    async def execute(
        self, command: str, arguments: dict[str, Any] | None = None, timeout: float = 10.0
    ) -> Any:
        """Run one command and return its ``return`` value; raise QmpError on ``error``."""
        message: dict[str, Any] = {"execute": command}
        if arguments:
            message["arguments"] = arguments
        async with self._command_lock:
            if self._writer is None or not self.connected:
                raise QmpError("not connected")
            self._pending = asyncio.get_running_loop().create_future()
            try:
                self._writer.write(json.dumps(message).encode() + b"\n")
                await self._writer.drain()
                async with asyncio.timeout(timeout):
                    reply = await self._pending
            finally:
                self._pending = None
        if "error" in reply:
            err = reply["error"]
            raise QmpError(f"{command}: {err.get('class')}: {err.get('desc')}")
        return reply.get("return")

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                message = json.loads(line)
                if "event" in message:
                    for stream in list(self._streams):
                        stream._put(message)
                elif self._pending is not None and not self._pending.done():
                    self._pending.set_result(message)
        except (OSError, ValueError) as exc:
            self._fail(QmpError(f"QMP connection broke: {exc}"))
        else:
            self._fail(QmpError("QMP connection closed"))

    def _fail(self, exc: QmpError) -> None:
        if self._pending is not None and not self._pending.done():
            self._pending.set_exception(exc)
