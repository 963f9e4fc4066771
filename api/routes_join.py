"""/api/v1/join: a node's first-boot call with its one-time join token (no bearer token)."""

from __future__ import annotations

import asyncio
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


class JoinResponse(BaseModel):
    overlay_address: str
    hub: HubInfo
    allowed_ips: list[str]
    persistent_keepalive: int
    cluster: dict[str, Any]


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
    public key, allowed IPs, keepalive and the cluster's join material; the token is burned."""
    b: JoinRequest = req.body
    result = await req.ctx.store.run(
        clusters.join, req.ctx.secrets, b.token, b.public_key, instance=req.ctx.instance
    )
    hubs = req.ctx.services.get("tenant_hubs")
    if hubs is not None:  # else the stored peer is applied when the hub is (re)started
        try:
            await asyncio.to_thread(_apply_peer, hubs, result)
        except Exception:  # the peer is stored; the hub picks it up when it is restarted
            log.exception("could not add the peer of machine %s to its hub", result.peer.machine_id)
    return JoinResponse.model_validate(result.response())
