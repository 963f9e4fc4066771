"""What the daemon hosts: services with start/stop on the one asyncio loop."""

from __future__ import annotations

from typing import Protocol


class Service(Protocol):
    """A long-running part of metald (API server, DHCP, TFTP, BMC scheduler ...).

    ``start`` returns once the service is serving (sockets bound); ``stop`` releases everything
    and returns once it has. Both are called on the daemon's loop.
    """

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
