"""/api/v1/instances: the metald instances sharing this store, alive or not, and their share."""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field
from sqlmodel import Session, select

from api.paging import PageQuery, page_items
from api.routing import STAFF, ApiRequest, Router
from metald.fleet import registry
from metald.store.models import Bmc

router = Router()


class InstanceQuery(PageQuery):
    SORTABLE = ("name", "started_at", "heartbeat_age_s")


TAG = "instances"


class InstanceOwns(BaseModel):
    bmcs: int = Field(description="BMCs this instance owns now (power sync, commands).")
    networks: list[str] = Field(description="Provisioning networks it serves (CIDRs).")
    bmc_networks: list[str] = Field(description="BMC networks it may own; empty: any.")
    hubs: bool = Field(description="Whether it may run tenants' hubs ([tenants] hubs).")


class InstanceOut(BaseModel):
    name: str
    alive: bool
    heartbeat_age_s: float
    version: str
    api_url: str | None = None
    host: str | None = None
    started_at: datetime | None = None
    owns: InstanceOwns


class InstanceList(BaseModel):
    items: list[InstanceOut]
    total: int
    limit: int
    offset: int
    next: str | None = Field(default=None, description="The next page, absent on the last.")
    #: The instance that answered this request.
    answered_by: str


@router.route(
    "GET",
    "/api/v1/instances",
    summary="List metald instances",
    roles=STAFF,
    query=InstanceQuery,
    response=InstanceList,
    tag=TAG,
)
async def list_instances(req: ApiRequest) -> InstanceList:
    """Every instance recorded in the store with its liveness (by the database's clock) and
    what it owns now. Dead instances stay listed (alive false) with owns.bmcs 0."""
    fleet = req.ctx.services.fleet
    dead_after = req.ctx.cfg.fleet.dead_after_s

    def run(s: Session) -> tuple[list[registry.Member], list[tuple[str, str]]]:
        rows = s.exec(select(Bmc.id, Bmc.address)).all()
        return registry.members(s, dead_after), [(r[0], r[1]) for r in rows]

    members, bmcs = await req.ctx.store.run(run)
    owners: Counter[str | None] = Counter()
    if fleet is not None:
        fleet.members = members  # the freshest view answers
        owners.update(fleet.bmc_owner(i, a) for i, a in bmcs)
    items = [
        InstanceOut(
            name=m.name,
            alive=m.alive,
            heartbeat_age_s=m.heartbeat_age_s,
            version=m.version,
            api_url=m.api_url,
            host=m.host,
            started_at=m.started_at,
            owns=InstanceOwns(
                bmcs=owners.get(m.name, 0) if m.alive else 0,
                networks=list(m.serves.get("provisioning_networks") or []),
                bmc_networks=list(m.serves.get("bmc_networks") or []),
                hubs=bool(m.serves.get("hubs")),
            ),
        )
        for m in members
    ]
    q: InstanceQuery = req.query
    limit = req.page_limit(q)
    # An instance's name is unique: it stands in for the id as the last sort key.
    page, cursor = page_items(items, q, ["name", "id"], limit, _field)
    return InstanceList(
        items=page,
        total=len(items),
        limit=limit,
        offset=q.offset,
        next=req.next_link(cursor),
        answered_by=req.ctx.instance,
    )


def _field(item: InstanceOut, field: str) -> Any:
    return item.name if field == "id" else getattr(item, field)
