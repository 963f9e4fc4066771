"""Event fan-out for live streams.

Events are rows in the store (the truth, shared by every instance on one database). The bus
only wakes local stream readers early; readers then query rows after their last seen id, so a
stream also sees events written by other metald instances (at the polling interval).
"""

from __future__ import annotations

import asyncio
import contextlib


class EventBus:
    def __init__(self) -> None:
        self._cond: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def notify(self) -> None:
        """Wake readers (call from the loop after committing events)."""
        cond = self._condition()

        async def _wake() -> None:
            async with cond:
                cond.notify_all()

        asyncio.get_running_loop().create_task(_wake())

    async def wait(self, timeout: float) -> None:
        cond = self._condition()
        async with cond:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cond.wait(), timeout)
