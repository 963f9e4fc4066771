"""The token purge as a daemon service: every ``interval_s``, delete long-dead tokens.

The sweep itself is ``metald.auth.purge_tokens`` (one DELETE, safe to run on several instances
at once); this service only calls it periodically and records what it removed. In a fleet it
runs on one instance: the rendezvous owner of ``sweep:tokens`` among the live ones (another
takes it over when that one dies), so the purge and its event happen once, not once per instance.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from sqlmodel import Session

from metald.auth import TOKEN_RETENTION, purge_tokens
from metald.machines import add_event
from metald.service import TaskScope, cancel
from metald.store.db import Store

log = logging.getLogger(__name__)


def purge_and_record(s: Session, *, actor: str, instance: str | None) -> int:
    n = purge_tokens(s)
    if n:
        add_event(
            s,
            "tokens.purged",
            actor,
            data={"count": n, "retention_s": int(TOKEN_RETENTION.total_seconds())},
            instance=instance,
        )
        s.commit()
    return n


#: The fleet-wide key whose owner runs the purge.
SWEEP_KEY = "sweep:tokens"


class KeyOwnership(Protocol):
    """Which instance of a fleet does a fleet-wide job (``metald.fleet.membership``)."""

    def owns_key(self, key: str) -> bool: ...


class TokenSweeper:
    name = "token-sweeper"

    def __init__(
        self,
        store: Store,
        instance: str,
        *,
        interval_s: float = 3600.0,
        ownership: KeyOwnership | None = None,
        tasks: TaskScope | None = None,
    ) -> None:
        self.store = store
        self.instance = instance
        self.interval_s = interval_s
        #: The fleet's Membership (``owns_key``); None: this instance is the only one.
        self.ownership = ownership
        self.tasks = tasks if tasks is not None else TaskScope(self.name)
        self._task: asyncio.Task[None | None] | None = None

    async def start(self) -> None:
        await self.tasks.open()
        self._task = self.tasks.spawn(self._loop(), name="token-sweeper")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
        await self.tasks.close()

    async def sweep_once(self) -> int:
        """Purge now if this instance owns the sweep; the number of tokens removed."""
        if self.ownership is not None and not self.ownership.owns_key(SWEEP_KEY):
            return 0
        return await self.store.run(
            purge_and_record, actor=f"metald:{self.instance}", instance=self.instance
        )

    async def _loop(self) -> None:
        while True:
            try:
                n = await self.sweep_once()
                if n:
                    log.info("purged %d revoked or expired tokens", n)
            except Exception:
                log.exception("token purge failed; trying again in %g s", self.interval_s)
            await asyncio.sleep(self.interval_s)
