"""The metald instances sharing this store, alive or not, and what each owns now."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

from sqlmodel import Session, select

from metald.fleet import registry
from metald.store.models import Bmc
from metald.usecases import Transactions
from metald.usecases.reads import Page, Pager, page_items

#: By name (unique: it stands in for the id as the last sort key).
DEFAULT_ORDER = ["name", "id"]


class FleetView(Protocol):
    """This instance's fleet membership (``metald.fleet``): who is alive, who owns a BMC."""

    members: list[registry.Member]

    def bmc_owner(self, bmc_id: str, address: str) -> str | None: ...


def _field(item: dict[str, Any], field: str) -> Any:
    return item["name"] if field == "id" else item[field]


@dataclass
class Instances:
    store: Transactions
    #: fleet.dead_after_s: an instance whose heartbeat is older is dead.
    dead_after_s: float
    #: The fleet service; None when this daemon runs alone (no BMC is counted as owned).
    fleet: FleetView | None

    async def list(self, pager: Pager) -> Page[dict[str, Any]]:
        """Every instance recorded in the store with its liveness (by the database's clock)
        and what it owns now; dead ones own no BMC."""

        def run(s: Session) -> tuple[list[registry.Member], list[tuple[str, str]]]:
            rows = s.exec(select(Bmc.id, Bmc.address)).all()
            return registry.members(s, self.dead_after_s), [(r[0], r[1]) for r in rows]

        members, bmcs = await self.store.run(run)
        owners: Counter[str | None] = Counter()
        if self.fleet is not None:
            self.fleet.members = members  # the freshest view answers
            owners.update(self.fleet.bmc_owner(i, a) for i, a in bmcs)
        items = [
            {
                "name": m.name,
                "alive": m.alive,
                "heartbeat_age_s": m.heartbeat_age_s,
                "version": m.version,
                "api_url": m.api_url,
                "host": m.host,
                "started_at": m.started_at,
                "owns": {
                    "bmcs": owners.get(m.name, 0) if m.alive else 0,
                    "networks": list(m.serves.get("provisioning_networks") or []),
                    "bmc_networks": list(m.serves.get("bmc_networks") or []),
                    "hubs": bool(m.serves.get("hubs")),
                },
            }
            for m in members
        ]
        return page_items(items, pager, DEFAULT_ORDER, lambda rows: rows, get=_field)
