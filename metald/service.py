"""What the daemon hosts: services with start/stop on the one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol


class Service(Protocol):
    """A long-running part of metald (API server, DHCP, TFTP, BMC scheduler ...).

    ``start`` returns once the service is serving (sockets bound); ``stop`` releases everything
    and returns once it has. Both are called on the daemon's loop.
    """

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def cancel(task: asyncio.Task[Any] | None) -> None:
    """Cancel a service's background task (if any) and return once it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
