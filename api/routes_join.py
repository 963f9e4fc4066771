"""/api/v1/join: a node's first-boot call with its one-time join token (no bearer token)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from typing import Annotated, Any

from pydantic import BaseModel, StringConstraints

from api.routing import ApiRequest, Router
from api.schemas import In
from metald.tenants import clusters
from metald.tenants.hubs import HubRuntime

log = logging.getLogger("metald.tenants")
router = Router()
Key = Annotated[str, StringConstraints(min_length=1, max_length=64)]


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


def _apply_peer(hubs: HubRuntime, result: clusters.JoinResult) -> None:
    hubs.add_peer(result.hub.tenant_id, result.peer.public_key, result.peer.address)


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
        lambda s: clusters.join(
            s,
            req.ctx.secrets,
            b.token,
            b.public_key,
            instance=req.ctx.instance,
            registered_from=_remote_ip(req),
        )
    )
    req.ctx.services.mesh_watch.changed(result.hub.tenant_id)
    hubs = req.ctx.services.tenant_hubs
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
