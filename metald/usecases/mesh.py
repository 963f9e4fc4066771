"""A tenant node's view of its tenant's mesh, with its own node token: the acknowledgement of
the generation it applied, then (held up to ``wait_s``) its peers, hub and guard once the
tenant's generation is newer (``metald.tenants.mesh``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from metald.limits import Limiter
from metald.store import Store
from metald.tenants import mesh


@dataclass
class Mesh:
    store: Store
    watch: mesh.MeshWatch
    #: Caps on held polls: per node token and per instance (429 past either).
    polls: Limiter

    async def sync(self, secret: str, applied: int, wait_s: float) -> dict[str, Any]:
        """Record ``applied`` as the node's acknowledgement, then answer its mesh once the
        tenant's generation is newer than ``applied`` or after ``wait_s`` seconds. A node
        released meanwhile is answered 401 (the token is checked again)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        v, moved = await self.store.run(mesh.sync, secret, applied)  # the ack comes first
        if moved:
            self.watch.acked(v.tenant_id)
        gen = v.generation
        if gen <= applied and wait_s > 0:
            # A held poll counts against its node's token and the instance (429 past either).
            with self.polls.holding(token=v.machine_id):
                while gen <= applied and (left := deadline - loop.time()) > 0:
                    await self.watch.wait_changed(v.tenant_id, min(left, mesh.STORE_POLL_S))
                    gen = await self.watch.generation(self.store, v.tenant_id)
        if gen != v.generation:  # authenticated again: a released node's poll ends in a 401
            v = await self.store.run(mesh.view_for_token, secret)
        out: dict[str, Any] = v.response()
        return out
