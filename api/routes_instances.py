"""/api/v1/instances: the metald instances sharing this store, alive or not, and their share."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from api import listing, workflows
from api.paging import PageQuery
from api.routing import STAFF, ApiRequest, Router
from api.schemas import ListPage
from metald.usecases.instances import Instances

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


class InstanceList(ListPage[InstanceOut]):
    """One page of the fleet's instances."""

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
    use_case=workflows.instances,
)
async def list_instances(req: ApiRequest, instances: Instances) -> InstanceList:
    """Every instance recorded in the store with its liveness (by the database's clock) and
    what it owns now. Dead instances stay listed (alive false) with owns.bmcs 0."""
    return await listing.listed(req, InstanceList, instances.list, answered_by=req.ctx.instance)
