"""Power sync: read the power state of every BMC this instance owns, on an interval.

A change nobody asked for becomes a ``bmc.power-drift`` event; a reading that differs from a
command metald sent within ``drift_grace_s`` is the command taking effect, not drift. Each
round first settles ownership (``BmcExecutor.sync_ownership``), so with several instances each
BMC is read by exactly one of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from sqlmodel import Session, select

from metald.bmc.base import BmcError, PowerState, cause
from metald.bmc.chassis import record_powers
from metald.bmc.executor import BmcExecutor
from metald.bmc.scheduler import Health
from metald.service import TaskScope, cancel
from metald.store.models import Bmc

log = logging.getLogger(__name__)

#: Readings recorded per store transaction. A round used to be a transaction a BMC, each a
#: commit even when nothing changed: at 10,000 BMCs that was most of an idle fleet's store work
#: (161 commits/s, bench/FLEET.md); now it is a read of this many rows, and a write only for
#: those whose power moved.
RECORD_BATCH = 256


@dataclass(frozen=True, slots=True)
class Reading:
    """A BMC's power as one round read it: ``drift_actor`` None within the grace of metald's
    own command; ``started`` (monotonic) when the read was asked for."""

    bmc_id: str
    observed: PowerState
    drift_actor: str | None
    started: float


class PowerSync:
    def __init__(self, control: BmcExecutor, interval_s: float, actor: str) -> None:
        self.control = control
        self.interval_s = interval_s
        self.actor = actor
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._settle: asyncio.Task[None | None] | None = None
        #: A wake came while a settle ran: that settle may have read the older live set.
        self._settle_again = False
        self._scope = TaskScope("bmc-ownership")

    async def start(self) -> None:
        await self._scope.open()
        # With a fleet the loop also settles ownership (acquire, release), so it runs even
        # with power sync turned off.
        if self.interval_s > 0 or self.control.ownership is not None:
            self._task = asyncio.create_task(self._loop(), name="bmc-power-sync")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
        await self._scope.close()
        self._settle = None

    def wake(self) -> None:
        """Settle ownership now (the live set changed), not at the next interval, and not
        after the power round in progress (over a thousand BMCs, seconds): a settle of its own
        at once, beside that round, then the round again."""
        self._wake.set()
        if self.control.ownership is None or not self._scope.is_open:
            return
        if self._settle is None or self._settle.done():
            self._settle = self._scope.spawn(self._settle_now(), name="bmc-ownership-settle")
        else:
            # The settle in progress may have computed its BMCs from the live set before this
            # change: it runs again when it ends. (Left to the loop, the next settle could
            # wait out a whole power round, minutes under load, with a BMC held by an instance
            # whose own hash gives it to another: its commands wait that long.)
            self._settle_again = True

    async def _settle_now(self) -> None:
        while True:
            self._settle_again = False
            try:
                await self.control.sync_ownership()
            except Exception:
                log.exception("settling BMC ownership failed")
            if not self._settle_again:
                return

    async def _loop(self) -> None:
        while True:
            try:
                if self.interval_s > 0:
                    await self.sync_power_once()
                else:
                    await self.control.sync_ownership()
            except Exception:
                log.exception("BMC power sync round failed")
            self._wake.clear()
            try:
                async with asyncio.timeout(self.interval_s if self.interval_s > 0 else 30.0):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def sync_power_once(self) -> int:
        """Read the power state of every BMC this instance owns (skipping auth-failed ones:
        retrying locks accounts) and record the readings ``RECORD_BATCH`` at a time, the rest
        at the round's end (a reading waits at most for the round's slowest BMC); returns how
        many drifted."""
        c = self.control
        await c.sync_ownership()

        def rows(s: Session) -> list[Bmc]:
            return list(s.exec(select(Bmc).where(Bmc.health != Health.AUTH_FAILED.value)).all())

        pending: list[Reading] = []
        drifted = 0

        async def flush() -> None:
            nonlocal drifted
            batch = [r for r in pending if not self.superseded(r)]
            pending.clear()
            if batch:
                drifted += await c.store.run(
                    record_powers,
                    [(r.bmc_id, r.observed, r.drift_actor) for r in batch],
                    c.instance,
                )

        async def one(row: Bmc) -> None:
            if row.last_seen_at is None and not await self.verify(row):
                return
            started = time.monotonic()
            try:
                state = await c.run(row, "sync_power", lambda d: d.get_power())
            except BmcError as e:
                log.debug("power sync of BMC %s failed: %s", row.id, cause(e))
                return
            pending.append(self.reading(row, state, started))
            if len(pending) >= RECORD_BATCH:
                await flush()

        # Held in the store, not only given by the hash: while a BMC moves, its previous holder
        # reads it until it lets go, and the new owner from when it acquired it, never both.
        owned = [
            r
            for r in await c.store.run(rows)
            if c.owns(r) and (c.ownership is None or r.id in c.held)
        ]
        await asyncio.gather(*(one(r) for r in owned))
        await flush()
        return drifted

    async def verify(self, row: Bmc) -> bool:
        """A BMC registered without verification (``verify=false``; never seen): ask it who it
        is, then keep that and link it (``registry.record_identity``). False: not yet."""
        from metald.bmc.registry import record_identity

        try:
            ident = await self.control.run(row, "identify", lambda d: d.identify())
        except BmcError as e:
            log.debug("BMC %s (registered unverified) still does not answer: %s", row.id, cause(e))
            return False
        await self.control.store.run(record_identity, row.id, ident, self.control.instance)
        return True

    def reading(self, row: Bmc, observed: PowerState, started: float) -> Reading:
        """A power reading as it came back: drift is judged now, against the command metald
        sent last (a reading within its grace is that command taking effect)."""
        expected = self.control.expected.get(row.id)
        in_grace = expected is not None and time.monotonic() < expected.until
        if expected is not None and not in_grace:
            self.control.expected.pop(row.id, None)
        return Reading(row.id, observed, None if in_grace else self.actor, started)

    def superseded(self, r: Reading) -> bool:
        """Whether metald sent the BMC a power command after this reading was asked for: the
        reading may predate it, and the command's confirmation records what the BMC reports
        (recorded late, the older reading would overwrite it until the next round)."""
        expected = self.control.expected.get(r.bmc_id)
        return expected is not None and expected.until - self.control.cfg.drift_grace_s > r.started
