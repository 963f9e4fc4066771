"""Where machines sit in the fabric, as the API shows and changes it: NVLink domains and
InfiniBand leaves with their members, one machine's topology, and the fabric's links uploaded
from ``ibnetdiscover`` (``metald.topology``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlmodel import Session

from metald import machines as svc
from metald import topology
from metald.auth import Principal
from metald.errors import Unprocessable
from metald.inventory.ibnet import IbnetError, parse_ibnetdiscover
from metald.usecases import Transactions, nothing
from metald.usecases.machines import load_visible


@dataclass
class Topology:
    store: Transactions
    instance: str | None = None
    notify: Any = nothing

    async def nvlink_domains(self) -> list[dict[str, Any]]:
        return await self.store.read(topology.nvlink_domains)

    async def ib_leaves(self) -> list[dict[str, Any]]:
        return await self.store.read(topology.ib_leaves)

    async def machine(self, p: Principal, machine_id: str) -> dict[str, Any]:
        def run(s: Session) -> dict[str, Any]:
            return topology.machine_topology(s, load_visible(s, p, machine_id))

        return await self.store.read(run)

    async def upload_ib_fabric(self, text: str, *, actor: str) -> dict[str, Any]:
        """Replace the fabric's links with those of an ``ibnetdiscover`` output and set every
        machine's leaf from them, in one transaction with an ``ib-fabric.updated`` event."""
        try:
            links = parse_ibnetdiscover(text)
        except IbnetError as e:
            raise Unprocessable(str(e)) from None

        def run(s: Session) -> dict[str, Any]:
            out = topology.replace_links(s, links)
            svc.add_event(
                s,
                "ib-fabric.updated",
                actor,
                data={k: out[k] for k in ("links", "switches", "machines_changed")},
                instance=self.instance,
            )
            s.commit()
            return out

        out = await self.store.run(run)
        self.notify()
        return out
