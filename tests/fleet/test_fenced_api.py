"""A fenced instance answers 503 problem+json with Retry-After at once for what needs the
store or ownership, without asking a store it cannot reach; health and metrics say fenced."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from api.app import CTX_KEY
from metald.fleet.membership import Membership
from metald.store import Store
from tests.api_helpers import use_services
from tests.fleet.test_membership import wait_for


class Cut:
    """The store behind a link that can be cut: calls made while it is cut wait until it
    heals (a link cut without a reset), then go through."""

    def __init__(self, store: Store) -> None:
        self.store = store
        # A thread's event: the heartbeat runs on a loop of its own (its own thread).
        self.healed = threading.Event()
        self.healed.set()
        self.asked_while_cut = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def _wait(self) -> None:
        if not self.healed.is_set():
            self.asked_while_cut += 1
            while not self.healed.is_set():
                await asyncio.sleep(0.01)

    async def run(self, fn, *a, **kw):  # type: ignore[no-untyped-def]
        await self._wait()
        return await self.store.run(fn, *a, **kw)

    async def read(self, fn, *a, **kw):  # type: ignore[no-untyped-def]
        await self._wait()
        return await self.store.read(fn, *a, **kw)

    async def heartbeat(self, fn, *a, **kw):  # type: ignore[no-untyped-def]
        await self._wait()
        return await self.store.heartbeat(fn, *a, **kw)


async def test_a_fenced_instance_answers_503_at_once_and_says_so(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    ctx = client.server.app[CTX_KEY]
    link = Cut(store)
    ctx.store = link
    # Fenced ~1.8 s after the last heartbeat: long enough that a loaded CI host does not fence
    # it again once healed (with 0.5 s it did, between the 200 and the /metrics read below).
    fleet = Membership(link, "rack1", heartbeat_s=0.2, dead_after_s=2.0)  # type: ignore[arg-type]
    await fleet.start()
    use_services(ctx, fleet=fleet)
    admin = tokens.header("admin")
    try:
        assert (await client.get("/api/v1/machines", headers=admin)).status == 200
        link.healed.clear()
        await wait_for(lambda: fleet.fenced)
        asked = link.asked_while_cut  # the heartbeat's own call, waiting on the cut link

        # The old code asked the cut store first: this request then never came back.
        r = await asyncio.wait_for(client.get("/api/v1/machines", headers=admin), 30)
        assert r.status == 503
        assert r.headers["Content-Type"].startswith("application/problem+json")
        assert r.headers["Retry-After"] == "2"
        body = await r.json()
        assert body["title"] == "Instance fenced"
        assert "another instance" in body["detail"]
        r = await asyncio.wait_for(
            client.post(f"/api/v1/machines/{tokens.machine_free}/power/on", headers=admin), 30
        )
        assert r.status == 503

        r = await asyncio.wait_for(client.get("/healthz"), 30)
        assert r.status == 503
        health = await r.json()
        assert health["database"].startswith("fenced")
        assert health["services"]["fleet"] == "fenced (store unreachable)"
        r = await asyncio.wait_for(client.get("/metrics"), 30)
        assert r.status == 200
        assert "metald_fleet_fenced 1.0" in await r.text()
        assert (await client.get("/api/v1/openapi.json")).status == 200
        assert link.asked_while_cut == asked  # none of these asked the store

        link.healed.set()
        await wait_for(lambda: not fleet.fenced)
        assert (await client.get("/api/v1/machines", headers=admin)).status == 200
        r = await client.get("/metrics")
        assert "metald_fleet_fenced 0.0" in await r.text()
    finally:
        link.healed.set()
        await fleet.stop()
        use_services(ctx, fleet=None)
        ctx.store = store


async def test_a_heartbeat_that_hung_across_a_cut_does_not_lift_the_fence_for_a_moment(
    store: Store,
) -> None:
    """A heartbeat sent just before a cut and answered after it heals renews the lease from
    when it was sent: that lease has already run out, so the instance writes a fresh one at
    once instead of leaving the fence for a moment and fencing again until its next beat
    (owners would let go, take back and let go; seen as a flaky /metrics read here)."""
    link = Cut(store)
    fleet = Membership(link, "rack2", heartbeat_s=0.5, dead_after_s=1.5)  # type: ignore[arg-type]
    await fleet.start()
    await fleet.stop_beats()  # beats are driven by hand below
    try:
        link.healed.clear()
        beat = asyncio.create_task(fleet.beat_once())
        await wait_for(lambda: link.asked_while_cut >= 1 and fleet.fenced)
        link.healed.set()
        await beat
        assert not fleet.fenced
        # A lease as long as a fresh heartbeat gives, not the stale one's remainder.
        assert fleet.lease_until() - time.monotonic() > fleet.heartbeat_s
    finally:
        link.healed.set()
        await fleet.stop()
