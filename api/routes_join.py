"""/api/v1/join: a node's first-boot call with its one-time join token (no bearer token)."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any

from pydantic import BaseModel, StringConstraints

from api import workflows
from api.routing import ApiRequest, Router
from api.schemas import In
from metald.usecases.join import Join

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


@router.route(
    "POST",
    "/api/v1/join",
    summary="Join a tenant's cluster",
    roles=None,
    body=JoinRequest,
    response=JoinResponse,
    tag="tenants",
    errors=(401, 409, 422),
    use_case=workflows.join,
)
async def join(req: ApiRequest, join: Join) -> JoinResponse:
    """Called by a node on first boot with its one-time join token (no bearer token) and the
    WireGuard public key it generated. Returns its overlay address, the hub's endpoint and
    public key, allowed IPs, keepalive, the cluster's join material, and its node token for
    ``POST /api/v1/mesh``; the join token is burned. The address the call came from is the
    node's first mesh endpoint (until its hub sees where its WireGuard is)."""
    b: JoinRequest = req.body
    answer = await join.join(b.token, b.public_key, registered_from=_remote_ip(req))
    return JoinResponse.model_validate(answer)


def _remote_ip(req: ApiRequest) -> str | None:
    try:
        return str(ipaddress.ip_address(req.raw.remote or ""))
    except ValueError:
        return None
