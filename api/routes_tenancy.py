"""Tenant clusters: WireGuard hubs, one-time join tokens, and the node's join call."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from datetime import datetime, timedelta
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from sqlmodel import Session

from api.routing import STAFF, ApiRequest, Router
from metald.auth import Role
from metald.errors import NotFound, Unauthorized, Unprocessable
from metald.machines import get_machine
from metald.store.models import Tenant
from metald.tenants import fabric, mesh, service
from metald.tenants.hubs import HubRuntime
from metald.tenants.runtime import free_hub_address

log = logging.getLogger("metald.tenants")
router = Router()
ADMIN = frozenset({Role.ADMIN})
FLEET_AND_TENANTS = STAFF | {Role.ORCHESTRATOR}
#: A join token hands out the tenant's scheduler secrets (munge key) and a place on its hub:
#: only admin and the tenant's own orchestrator mint one, never a technician.
JOIN_MINTERS = frozenset({Role.ADMIN, Role.ORCHESTRATOR})

Key = Annotated[str, StringConstraints(min_length=1, max_length=64)]


class In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HubCreate(In):
    #: Underlay address (or DNS name) nodes dial; the hub listens on listen_port there. Omitted:
    #: the next free address of tenants.hub_addresses (when metald runs the hubs).
    endpoint_host: Annotated[str, StringConstraints(min_length=1, max_length=253)] | None = None
    listen_port: int = Field(default=service.DEFAULT_LISTEN_PORT, ge=1, le=65535)


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


class JoinTokenCreate(In):
    ttl_seconds: int = Field(default=1800, ge=60, le=86400)


class JoinTokenCreated(BaseModel):
    machine_id: str
    token: str
    expires_at: datetime


class JoinRequest(In):
    token: Annotated[str, StringConstraints(min_length=1, max_length=200)]
    public_key: Key


class HubInfo(BaseModel):
    endpoint: str
    public_key: str
    address: str


class MeshInfo(BaseModel):
    #: Where the node asks for its mesh view (POST, on the join URL's host).
    path: str
    #: The node's own credential for that call only; revoked with its peer (release).
    node_token: str
    listen_port: int


class JoinResponse(BaseModel):
    overlay_address: str
    hub: HubInfo
    allowed_ips: list[str]
    persistent_keepalive: int
    cluster: dict[str, Any]
    mesh: MeshInfo


class MeshSync(In):
    #: The mesh generation the node has applied (0: none yet): its acknowledgement.
    applied: int = Field(default=0, ge=0)
    #: Seconds to wait for a generation newer than ``applied`` (0: answer at once).
    wait_s: float = Field(default=0, ge=0, le=mesh.MAX_WAIT_S)


class MeshHub(BaseModel):
    public_key: str
    endpoint: str
    address: str
    allowed_ips: list[str]


class MeshPeer(BaseModel):
    public_key: str
    address: str
    allowed_ips: list[str]
    endpoint: str | None


class MeshGuard(BaseModel):
    wireguard_port: int
    #: Underlay addresses the node's guard admits WireGuard from (its peers' and the hub's).
    sources: list[str]


class MeshOut(BaseModel):
    generation: int
    address: str
    listen_port: int
    hub: MeshHub
    peers: list[MeshPeer]
    guard: MeshGuard


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


def _apply_peer(hubs: HubRuntime, result: service.JoinResult) -> None:
    hubs.add_peer(result.hub.tenant_id, result.peer.public_key, result.peer.address)


def _hub_out(s: Session, tenant: Tenant) -> HubOut:
    hub = service.get_hub(s, tenant.id)
    return HubOut(
        tenant_id=tenant.id,
        cluster_kind=tenant.cluster_kind,
        ifname=hub.ifname,
        public_key=hub.public_key,
        endpoint=hub.endpoint,
        listen_port=hub.listen_port,
        address=hub.address,
        overlay_prefix=tenant.overlay_prefix or "",
        peers=[PeerOut.model_validate(p.model_dump()) for p in service.peers(s, tenant.id)],
    )


def _tenant(s: Session, req: ApiRequest) -> Tenant:
    t = s.get(Tenant, req.params["id"])
    if t is None or not req.require_principal().can_see_tenant(t.id):
        raise NotFound(f"no tenant with id {req.params['id']!r}")
    return t


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
        service.setup_hub(s, req.ctx.secrets, t.id, endpoint_host=host, listen_port=b.listen_port)
        return _hub_out(s, t)

    out = await req.ctx.store.run(run)
    runtime = req.ctx.services.get("tenant_hubs")
    if runtime is not None and hasattr(runtime, "sync"):
        await runtime.sync()  # up now, not at the next interval (errors are logged there)
    return out


@router.route(
    "GET",
    "/api/v1/tenants/{id}/hub",
    summary="Show a tenant's hub",
    roles=FLEET_AND_TENANTS,
    response=HubOut,
    tag="tenants",
    errors=(404,),
)
async def show_hub(req: ApiRequest) -> HubOut:
    """The hub's public key, endpoint, overlay prefix and peers (never a private key)."""

    def run(s: Session) -> HubOut:
        return _hub_out(s, _tenant(s, req))

    return await req.ctx.store.run(run)


@router.route(
    "POST",
    "/api/v1/machines/{id}/join-token",
    summary="Issue a join token",
    roles=JOIN_MINTERS,
    body=JoinTokenCreate,
    response=JoinTokenCreated,
    status=201,
    tag="tenants",
    errors=(404, 409),
)
async def create_join_token(req: ApiRequest) -> JoinTokenCreated:
    """A one-time, short-lived token for the machine's first-boot metadata. The secret is in
    this response and nowhere else. Admin, or the orchestrator of the machine's tenant; 409
    while the machine is on its hub (a join never replaces an active peer)."""
    b: JoinTokenCreate = req.body
    p = req.require_principal()

    def run(s: Session) -> JoinTokenCreated:
        m = get_machine(s, req.params["id"])
        if not p.can_see_machine(m.id, m.tenant_id):
            raise NotFound(f"no machine with id {req.params['id']!r}")
        secret, expires = service.issue_join_token(
            s,
            m.id,
            actor=req.actor,
            ttl=timedelta(seconds=b.ttl_seconds),
            instance=req.ctx.instance,
        )
        return JoinTokenCreated(machine_id=m.id, token=secret, expires_at=expires)

    return await req.ctx.store.run(run)


@router.route(
    "DELETE",
    "/api/v1/machines/{id}/peer",
    summary="Revoke a node's place on its hub",
    roles=JOIN_MINTERS,
    response=PeerOut,
    tag="tenants",
    errors=(404,),
)
async def revoke_peer(req: ApiRequest) -> PeerOut:
    """Take the machine's WireGuard peer off its tenant's hub (and revoke its unused join
    tokens), with a ``tenant.peer.removed`` event: the explicit step before a node may join
    again with a new key (a fresh seed and join token), since a join never replaces an active
    peer. Admin, or the orchestrator of the machine's tenant."""
    p = req.require_principal()

    def run(s: Session) -> tuple[PeerOut, str]:
        m = get_machine(s, req.params["id"])
        if not p.can_see_machine(m.id, m.tenant_id):
            raise NotFound(f"no machine with id {req.params['id']!r}")
        peer = service.remove_peer(
            s, m.id, actor=req.actor, instance=req.ctx.instance, reason="revoked"
        )
        if peer is None:
            raise NotFound(f"machine {m.id} has no peer on a tenant's hub")
        s.commit()
        return PeerOut.model_validate(peer.model_dump()), peer.tenant_id

    out, tenant_id = await req.write(run)
    mesh.watch_of(req.ctx.services).changed(tenant_id)
    hubs = req.ctx.services.get("tenant_hubs")
    if hubs is not None:  # else the hub drops it when it next syncs with the store
        try:
            await asyncio.to_thread(hubs.remove_peer, tenant_id, out.public_key)
        except Exception:
            log.exception("could not take machine %s's peer off its hub", out.machine_id)
    return out


@router.route(
    "POST",
    "/api/v1/join",
    summary="Join a tenant's cluster",
    roles=None,
    body=JoinRequest,
    response=JoinResponse,
    tag="tenants",
    errors=(401, 409, 422),
)
async def join(req: ApiRequest) -> JoinResponse:
    """Called by a node on first boot with its one-time join token (no bearer token) and the
    WireGuard public key it generated. Returns its overlay address, the hub's endpoint and
    public key, allowed IPs, keepalive, the cluster's join material, and its node token for
    ``POST /api/v1/mesh``; the join token is burned. The address the call came from is the
    node's first mesh endpoint (until its hub sees where its WireGuard is)."""
    b: JoinRequest = req.body
    result = await req.ctx.store.run(
        lambda s: service.join(
            s,
            req.ctx.secrets,
            b.token,
            b.public_key,
            instance=req.ctx.instance,
            registered_from=_remote_ip(req),
        )
    )
    mesh.watch_of(req.ctx.services).changed(result.hub.tenant_id)
    hubs = req.ctx.services.get("tenant_hubs")
    if hubs is not None:  # else the stored peer is applied when the hub is (re)started
        try:
            await asyncio.to_thread(_apply_peer, hubs, result)
        except Exception:  # the peer is stored; the hub picks it up when it is restarted
            log.exception("could not add the peer of machine %s to its hub", result.peer.machine_id)
    return JoinResponse.model_validate(result.response())


def _remote_ip(req: ApiRequest) -> str | None:
    try:
        return str(ipaddress.ip_address(req.raw.remote or ""))
    except ValueError:
        return None


def _bearer(req: ApiRequest) -> str:
    auth = req.raw.headers.get("Authorization", "")
    scheme, _, secret = auth.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthorized("send this node's mesh token as 'Authorization: Bearer mnt_...'")
    return secret.strip()


@router.route(
    "POST",
    "/api/v1/mesh",
    summary="Fetch a node's mesh peers",
    roles=None,
    body=MeshSync,
    response=MeshOut,
    tag="tenants",
    errors=(401, 422),
)
async def mesh_sync(req: ApiRequest) -> MeshOut:
    """Called by a node with its node token (``Authorization: Bearer mnt_...``, from its join
    answer; no other token works here and this token works nowhere else). ``applied`` is the
    mesh generation it has applied, recorded as its acknowledgement (a release waits for it).
    Answers with its tenant's other nodes (public key, /32, endpoint), the hub, and the
    addresses its underlay guard admits WireGuard from, once the tenant's generation is newer
    than ``applied`` or after ``wait_s`` seconds. Never a peer of another tenant."""
    b: MeshSync = req.body
    secret = _bearer(req)
    watch = mesh.watch_of(req.ctx.services)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + b.wait_s
    v, moved = await req.ctx.store.run(mesh.sync, secret, b.applied)  # the ack comes first
    if moved:
        watch.acked(v.tenant_id)
    gen = v.generation
    while gen <= b.applied and (left := deadline - loop.time()) > 0:
        await watch.wait_changed(v.tenant_id, min(left, mesh.STORE_POLL_S))
        gen = await watch.generation(req.ctx.store, v.tenant_id)
    if gen != v.generation:  # authenticated again: a released node's poll ends in a 401
        v = await req.ctx.store.run(mesh.view_for_token, secret)
    return MeshOut.model_validate(v.response())


@router.route(
    "GET",
    "/api/v1/tenants/{id}/fabric",
    summary="Show a tenant's fabric partition",
    roles=FLEET_AND_TENANTS,
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
