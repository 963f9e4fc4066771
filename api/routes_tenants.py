"""/api/v1/tenants: tenants, and each tenant's WireGuard hub."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints

from api import listing, workflows
from api.roles import ADMIN, READERS
from api.routing import ApiRequest, Router
from api.schemas import In, TenantCreate, TenantList, TenantOut, TenantQuery
from metald.tenants import clusters
from metald.usecases.tenants import Tenants, hub_view

router = Router()


class HubCreate(In):
    #: Underlay address (or DNS name) nodes dial; the hub listens on listen_port there. Omitted:
    #: the next free address of tenants.hub_addresses (when metald runs the hubs).
    endpoint_host: Annotated[str, StringConstraints(min_length=1, max_length=253)] | None = None
    listen_port: int = Field(default=clusters.DEFAULT_LISTEN_PORT, ge=1, le=65535)


class PeerOut(BaseModel):
    machine_id: str
    address: str
    public_key: str
    last_handshake_at: datetime | None


class HubOut(BaseModel):
    tenant_id: str
    cluster_kind: str
    ifname: str
    public_key: str
    endpoint: str
    listen_port: int
    address: str
    overlay_prefix: str
    peers: list[PeerOut]


def _hub_out(s: Any, tenant: Any) -> HubOut:
    """The tenant's hub as the API shows it (``metald.usecases.tenants.hub_view``)."""
    return HubOut.model_validate(hub_view(s, tenant))


@router.route(
    "POST",
    "/api/v1/tenants",
    summary="Create a tenant",
    roles=ADMIN,
    body=TenantCreate,
    response=TenantOut,
    status=201,
    tag="tenants",
    errors=(409, 422),
    location="/api/v1/tenants/{id}",
    use_case=workflows.tenants,
)
async def create_tenant(req: ApiRequest, tenants: Tenants) -> TenantOut:
    """A tenant that orchestrator tokens can be scoped to."""
    b: TenantCreate = req.body
    t = await tenants.create(
        actor=req.actor, name=b.name, cluster_kind=b.cluster_kind, control_plane=b.control_plane
    )
    return TenantOut.model_validate(t)


@router.route(
    "GET",
    "/api/v1/tenants",
    summary="List tenants",
    roles=READERS,
    query=TenantQuery,
    response=TenantList,
    tag="tenants",
    use_case=workflows.tenants,
)
async def list_tenants(req: ApiRequest, tenants: Tenants) -> TenantList:
    """Tenants by name, paginated; an orchestrator sees only those in its scope."""
    p = req.require_principal()
    return await listing.listed(req, TenantList, lambda paging: tenants.list(p, paging))


@router.route(
    "GET",
    "/api/v1/tenants/{id}",
    summary="Show a tenant",
    roles=READERS,
    response=TenantOut,
    tag="tenants",
    errors=(404,),
    use_case=workflows.tenants,
)
async def show_tenant(req: ApiRequest, tenants: Tenants) -> TenantOut:
    """One tenant (never its secrets)."""
    return TenantOut.model_validate(await tenants.show(req.require_principal(), req.params["id"]))


@router.route(
    "POST",
    "/api/v1/tenants/{id}/hub",
    summary="Create a tenant's hub",
    roles=ADMIN,
    body=HubCreate,
    response=HubOut,
    status=201,
    tag="tenants",
    errors=(404, 409, 422),
    location="/api/v1/tenants/{tenant_id}/hub",
    use_case=workflows.tenants,
)
async def create_hub(req: ApiRequest, tenants: Tenants) -> HubOut:
    """Give the tenant its WireGuard hub (key pair, overlay prefix no other tenant overlaps,
    listen endpoint) and its scheduler secrets (munge key, or a Kubernetes CA), encrypted."""
    b: HubCreate = req.body
    hub = await tenants.create_hub(
        req.require_principal(),
        req.params["id"],
        endpoint_host=b.endpoint_host,
        listen_port=b.listen_port,
    )
    return HubOut.model_validate(hub)


@router.route(
    "GET",
    "/api/v1/tenants/{id}/hub",
    summary="Show a tenant's hub",
    roles=READERS,
    response=HubOut,
    tag="tenants",
    errors=(404,),
    use_case=workflows.tenants,
)
async def show_hub(req: ApiRequest, tenants: Tenants) -> HubOut:
    """The hub's public key, endpoint, overlay prefix and peers (never a private key)."""
    return HubOut.model_validate(await tenants.show_hub(req.require_principal(), req.params["id"]))


class FabricPort(BaseModel):
    machine_id: str
    port_guids: list[str]


class FabricOut(BaseModel):
    tenant_id: str
    vlan: int | None
    pkey: int
    pkey_hex: str
    machines: list[FabricPort]
    partitions_conf: str


@router.route(
    "GET",
    "/api/v1/tenants/{id}/fabric",
    summary="Show a tenant's fabric partition",
    roles=READERS,
    response=FabricOut,
    tag="tenants",
    errors=(404, 409),
    use_case=workflows.tenants,
)
async def show_fabric(req: ApiRequest, tenants: Tenants) -> FabricOut:
    """What a subnet manager or switch automation needs for the tenant: its VLAN id, its
    InfiniBand partition key (allocated now for a tenant from before PKeys), each machine it
    holds with its port GUIDs (from inventory, when listed), and an OpenSM partitions.conf
    fragment."""
    return FabricOut.model_validate(
        await tenants.show_fabric(req.require_principal(), req.params["id"])
    )
