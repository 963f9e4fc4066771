"""A fenced instance answers 503 problem+json with Retry-After at once for what needs the
store or ownership, without asking a store it cannot reach; health and metrics say fenced."""

from __future__ import annotations

import asyncio
from typing import Any

from api.app import CTX_KEY
from metald.fleet.membership import Membership
from metald.store import Store
from tests.fleet.test_membership import wait_for


class Cut:
    """The store behind a link that can be cut: calls made while it is cut wait until it
    heals (a link cut without a reset), then go through."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.healed = asyncio.Event()
        self.healed.set()
        self.asked_while_cut = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def _wait(self) -> None:
        if not self.healed.is_set():
            self.asked_while_cut += 1
            await self.healed.wait()

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
    fleet = Membership(link, "rack1", heartbeat_s=0.1, dead_after_s=0.6)  # type: ignore[arg-type]
    await fleet.start()
    ctx.services["fleet"] = fleet
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
        ctx.services.pop("fleet", None)
        ctx.store = store
