"""/api/v1/tenants: tenants, and each tenant's WireGuard hub."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints
from sqlalchemy import func
from sqlmodel import Session, col, select

from api.paging import page_rows
from api.roles import ADMIN, READERS
from api.routing import ApiRequest, Router
from api.schemas import In, TenantCreate, TenantList, TenantOut, TenantQuery
from api.workflows import tenant_runtime
from metald.auth import Role
from metald.errors import NotFound, Unprocessable
from metald.store.models import Tenant
from metald.tenants import clusters, fabric
from metald.tenants.runtime import free_hub_address

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


def _hub_out(s: Session, tenant: Tenant) -> HubOut:
    hub = clusters.get_hub(s, tenant.id)
    return HubOut(
        tenant_id=tenant.id,
        cluster_kind=tenant.cluster_kind,
        ifname=hub.ifname,
        public_key=hub.public_key,
        endpoint=hub.endpoint,
        listen_port=hub.listen_port,
        address=hub.address,
        overlay_prefix=tenant.overlay_prefix or "",
        peers=[PeerOut.model_validate(p.model_dump()) for p in clusters.peers(s, tenant.id)],
    )


def _tenant(s: Session, req: ApiRequest) -> Tenant:
    t = s.get(Tenant, req.params["id"])
    if t is None or not req.require_principal().can_see_tenant(t.id):
        raise NotFound(f"no tenant with id {req.params['id']!r}")
    return t


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
)
async def create_tenant(req: ApiRequest) -> TenantOut:
    """A tenant that orchestrator tokens can be scoped to."""
    b: TenantCreate = req.body

    def run(s: Session) -> TenantOut:
        t = clusters.add_tenant(
            s,
            name=b.name,
            cluster_kind=b.cluster_kind,
            control_plane=b.control_plane,
            vlan_range=req.ctx.cfg.tenants.vlan_range,
            actor=req.actor,
            instance=req.ctx.instance,
        )
        return TenantOut.model_validate(t.model_dump())

    return await req.ctx.store.run(run)


@router.route(
    "GET",
    "/api/v1/tenants",
    summary="List tenants",
    roles=READERS,
    query=TenantQuery,
    response=TenantList,
    tag="tenants",
)
async def list_tenants(req: ApiRequest) -> TenantList:
    """Tenants by name, paginated; an orchestrator sees only those in its scope."""
    p = req.require_principal()
    q: TenantQuery = req.query
    limit = req.page_limit(q)

    def run(s: Session) -> TenantList:
        stmt = select(Tenant)
        if p.role is Role.ORCHESTRATOR:
            stmt = stmt.where(col(Tenant.id).in_(sorted(p.scope)))
        total = s.exec(select(func.count()).select_from(stmt.subquery())).one()
        rows, cursor = page_rows(s, stmt, Tenant, q, ["name", "id"], limit)
        return TenantList(
            items=[TenantOut.model_validate(t.model_dump()) for t in rows],
            total=total,
            limit=limit,
            offset=q.offset,
            next=req.next_link(cursor),
        )

    return await req.ctx.store.read(run)


@router.route(
    "GET",
    "/api/v1/tenants/{id}",
    summary="Show a tenant",
    roles=READERS,
    response=TenantOut,
    tag="tenants",
    errors=(404,),
)
async def show_tenant(req: ApiRequest) -> TenantOut:
    """One tenant (never its secrets)."""
    p = req.require_principal()

    def run(s: Session) -> TenantOut:
        t = s.get(Tenant, req.params["id"])
        if t is None or not p.can_see_tenant(t.id):
            raise NotFound(f"no tenant with id {req.params['id']!r}")
        return TenantOut.model_validate(t.model_dump())

    return await req.ctx.store.run(run)


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
)
async def create_hub(req: ApiRequest) -> HubOut:
    """Give the tenant its WireGuard hub (key pair, overlay prefix no other tenant overlaps,
    listen endpoint) and its scheduler secrets (munge key, or a Kubernetes CA), encrypted."""
    b: HubCreate = req.body

    pool = req.ctx.cfg.tenants.hub_addresses

    def run(s: Session) -> HubOut:
        t = _tenant(s, req)
        host = b.endpoint_host
        if host is None:
            if pool is None:
                raise Unprocessable(
                    "endpoint_host: required (tenants.hub_addresses is not configured)"
                )
            host = free_hub_address(s, pool)
        clusters.setup_hub(s, req.ctx.secrets, t.id, endpoint_host=host, listen_port=b.listen_port)
        return _hub_out(s, t)

    out = await req.ctx.store.run(run)
    runtime = tenant_runtime(req.ctx)
    if runtime is not None:
        await runtime.sync()  # up now, not at the next interval (errors are logged there)
    return out


@router.route(
    "GET",
    "/api/v1/tenants/{id}/hub",
    summary="Show a tenant's hub",
    roles=READERS,
    response=HubOut,
    tag="tenants",
    errors=(404,),
)
async def show_hub(req: ApiRequest) -> HubOut:
    """The hub's public key, endpoint, overlay prefix and peers (never a private key)."""

    def run(s: Session) -> HubOut:
        return _hub_out(s, _tenant(s, req))

    return await req.ctx.store.run(run)


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
)
async def show_fabric(req: ApiRequest) -> FabricOut:
    """What a subnet manager or switch automation needs for the tenant: its VLAN id, its
    InfiniBand partition key (allocated now for a tenant from before PKeys), each machine it
    holds with its port GUIDs (from inventory, when listed), and an OpenSM partitions.conf
    fragment."""

    def run(s: Session) -> FabricOut:
        t = _tenant(s, req)
        return FabricOut.model_validate(fabric.describe(s, t.id))

    return await req.ctx.store.run(run)
