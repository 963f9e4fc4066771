"""/api/v1/tenants/{id}/elastic-pools: a Slurm tenant's elastic pools (docs/elastic.md).

Admins, or an orchestrator for the tenants in its scope (as claims), set each pool's min, max,
selector and image; slurmctld's power saving then resumes its nodes into claims and suspends
them into releases. Staff read them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints

from api import workflows
from api.roles import ADMIN, CLAIMERS, READERS
from api.routes_claims import SelectorIn
from api.routing import ApiRequest, Router
from api.schemas import ImageRef, In, Name
from metald.usecases.elastic import ElasticPools

router = Router()
TAG = "elastic"
BASE = "/api/v1/tenants/{id}/elastic-pools"
Prefix = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9-]{0,30}$")]


class PoolCreate(In):
    name: Name
    prefix: Prefix = Field(description="Node names are <prefix>1 .. <prefix><max_nodes>.")
    min_nodes: int = Field(default=0, ge=0, le=4096, description="Never suspended below this.")
    max_nodes: int = Field(ge=1, le=4096, description="Node names reserved in slurm.conf.")
    selector: SelectorIn = SelectorIn()
    image_id: ImageRef = Field(description="The image each resumed node's machine installs.")
    suspend_time_s: int = Field(default=300, ge=1, le=86400 * 30)
    resume_timeout_s: int = Field(default=1800, ge=60, le=86400)


class PoolUpdate(In):
    min_nodes: int | None = Field(default=None, ge=0, le=4096)
    max_nodes: int | None = Field(default=None, ge=1, le=4096)
    selector: SelectorIn | None = None
    image_id: ImageRef | None = None
    suspend_time_s: int | None = Field(default=None, ge=1, le=86400 * 30)
    resume_timeout_s: int | None = Field(default=None, ge=60, le=86400)


class PoolOut(BaseModel):
    id: str
    tenant_id: str
    name: str
    prefix: str
    min_nodes: int
    max_nodes: int
    selector: dict[str, Any]
    image_id: str
    suspend_time_s: int
    resume_timeout_s: int
    hostlist: str = Field(description="The pool's CLOUD nodes in slurm.conf, e.g. e[1-3].")
    partition: str = Field(description="The Slurm partition of the pool's nodes.")
    nodes: dict[str, str] = Field(description="Node name -> the claim holding its machine.")
    version: int
    created_by: str | None
    created_at: datetime
    updated_at: datetime


class PoolList(BaseModel):
    items: list[PoolOut]


def _body(b: PoolCreate | PoolUpdate) -> dict[str, Any]:
    out = b.model_dump(exclude_none=True)
    if "image_id" in out:
        out["image"] = out.pop("image_id")
    return out


@router.route(
    "POST",
    BASE,
    summary="Create an elastic pool",
    roles=CLAIMERS,
    body=PoolCreate,
    response=PoolOut,
    status=201,
    location="/api/v1/tenants/{tenant_id}/elastic-pools/{id}",
    tag=TAG,
    errors=(404, 409, 422),
    use_case=workflows.elastic,
)
async def create_pool(req: ApiRequest, pools: ElasticPools) -> PoolOut:
    """Add ``<prefix>[1-max]`` as CLOUD nodes to the tenant's slurm.conf (its slurmctld
    restarts; jobs survive): jobs in the pool's partition make slurmctld resume them into
    claims, idle ones are suspended into releases."""
    out = await pools.create(
        req.require_principal(), req.params["id"], _body(req.body), actor=req.actor
    )
    return PoolOut.model_validate(out)


@router.route(
    "GET", BASE, summary="List elastic pools", roles=READERS, response=PoolList, tag=TAG,
    errors=(404,), use_case=workflows.elastic,
)  # fmt: skip
async def list_pools(req: ApiRequest, pools: ElasticPools) -> PoolList:
    """The tenant's pools, each with the nodes holding machines now."""
    rows = await pools.list(req.require_principal(), req.params["id"])
    return PoolList(items=[PoolOut.model_validate(r) for r in rows])


@router.route(
    "GET", BASE + "/{pool_id}", summary="Show an elastic pool", roles=READERS,
    response=PoolOut, tag=TAG, errors=(404,), use_case=workflows.elastic,
)  # fmt: skip
async def show_pool(req: ApiRequest, pools: ElasticPools) -> PoolOut:
    """One pool, with the nodes holding machines now."""
    out = await pools.show(req.require_principal(), req.params["id"], req.params["pool_id"])
    return PoolOut.model_validate(out)


@router.route(
    "PATCH", BASE + "/{pool_id}", summary="Change an elastic pool", roles=CLAIMERS,
    body=PoolUpdate, response=PoolOut, tag=TAG, errors=(404, 409, 422), versioned=True,
    use_case=workflows.elastic,
)  # fmt: skip
async def update_pool(req: ApiRequest, pools: ElasticPools) -> PoolOut:
    """Change min, max, selector, image or timers; lowering max below a node holding a
    machine is 409. Machines already claimed keep their image until suspended."""
    out = await pools.update(
        req.require_principal(), req.params["id"], req.params["pool_id"], _body(req.body),
        actor=req.actor, if_match=req.if_match,
    )  # fmt: skip
    return PoolOut.model_validate(out)


@router.route(
    "DELETE", BASE + "/{pool_id}", summary="Delete an elastic pool", roles=CLAIMERS,
    status=204, tag=TAG, errors=(404, 409), use_case=workflows.elastic,
)  # fmt: skip
async def delete_pool(req: ApiRequest, pools: ElasticPools) -> None:
    """Only a pool holding no machines (min 0, all suspended) can go."""
    await pools.delete(
        req.require_principal(), req.params["id"], req.params["pool_id"], actor=req.actor
    )


class QuotaIn(In):
    max_machines: int | None = Field(
        default=None,
        ge=0,
        le=100000,
        description="Machines the tenant holds at once; null: "
        "no cap. Counted over all its machines; enforced when its pools resume nodes.",
    )
    per_sku: dict[Name, int] = Field(
        default={},
        max_length=64,
        description="GPU model -> machines of that model at once; applies to pools whose "
        "selector names that exact gpu_model.",
    )


class QuotaOut(BaseModel):
    tenant_id: str
    max_machines: int | None
    per_sku: dict[str, int]
    updated_by: str | None = None
    updated_at: datetime | None = None


QUOTA = "/api/v1/tenants/{id}/elastic-quota"


@router.route(
    "GET", QUOTA, summary="Show a tenant's elastic quota", roles=READERS, response=QuotaOut,
    tag=TAG, errors=(404,), use_case=workflows.elastic,
)  # fmt: skip
async def show_quota(req: ApiRequest, pools: ElasticPools) -> QuotaOut:
    """What the tenant's pools may hold at once (null and {}: no cap but the pools' max)."""
    return QuotaOut.model_validate(await pools.quota(req.require_principal(), req.params["id"]))


@router.route(
    "PUT", QUOTA, summary="Set a tenant's elastic quota", roles=ADMIN, body=QuotaIn,
    response=QuotaOut, tag=TAG, errors=(404, 422), use_case=workflows.elastic,
)  # fmt: skip
async def set_quota(req: ApiRequest, pools: ElasticPools) -> QuotaOut:
    """Admins cap the tenant's machines at once, overall and per GPU model; nodes its pools
    resume beyond the cap are set down with ``elastic: the tenant's quota is used up``."""
    b: QuotaIn = req.body
    out = await pools.set_quota(
        req.require_principal(), req.params["id"], b.max_machines, dict(b.per_sku),
        actor=req.actor,
    )  # fmt: skip
    return QuotaOut.model_validate(out)
