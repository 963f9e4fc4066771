"""A change of the fleet's live set settles BMC ownership with that live set, even when it
comes while a settle is running (bench/FLEET.md: a released wipe waited 7 minutes at 10,000
machines on a BMC whose holder's own hash gave it to another instance)."""

from __future__ import annotations

import asyncio

from metald.bmc.power_sync import PowerSync


class _Control:
    """Stands in for the executor's ownership settle: records the live-set version each
    settle starts from; the first settle waits on ``gate``."""

    def __init__(self) -> None:
        self.ownership = object()
        self.view = 0
        self.seen: list[int] = []
        self.gate = asyncio.Event()

    async def sync_ownership(self) -> None:
        self.seen.append(self.view)
        await self.gate.wait()


async def test_a_wake_during_a_settle_settles_again_with_the_newer_live_set() -> None:
    c = _Control()
    sync = PowerSync(c, interval_s=0, actor="test")  # type: ignore[arg-type]
    await sync._scope.open()
    try:
        sync.wake()  # a peer died: a settle starts from view 0
        await asyncio.sleep(0)
        assert c.seen == [0]
        c.view = 1  # the peer came back while that settle still runs
        sync.wake()
        c.gate.set()
        settle = sync._settle
        assert settle is not None
        await asyncio.wait_for(settle, 10)
        # Fails on the old code: the second wake found a settle running and spawned none.
        assert c.seen == [0, 1]
        # A wake once all is settled starts one settle, not a loop.
        sync.wake()
        again = sync._settle
        assert again is not None and again is not settle
        await asyncio.wait_for(again, 10)
        assert c.seen == [0, 1, 1]
    finally:
        await sync._scope.close()


async def test_wakes_while_no_settle_runs_each_settle_once() -> None:
    c = _Control()
    c.gate.set()
    sync = PowerSync(c, interval_s=0, actor="test")  # type: ignore[arg-type]
    await sync._scope.open()
    try:
        for view in (1, 2):
            c.view = view
            sync.wake()
            settle = sync._settle
            assert settle is not None
            await asyncio.wait_for(settle, 10)
        assert c.seen == [1, 2]
    finally:
        await sync._scope.close()
