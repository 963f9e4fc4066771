"""/api/v1/mesh: a tenant node's view of its tenant's mesh, with its own node token."""

from __future__ import annotations

from pydantic import BaseModel, Field

from api import workflows
from api.routing import ApiRequest, Router
from api.schemas import In
from metald.errors import Unauthorized
from metald.tenants import mesh
from metald.usecases.mesh import Mesh

router = Router()


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
    errors=(401, 422, 429),
    use_case=workflows.mesh_nodes,
)
async def mesh_sync(req: ApiRequest, nodes: Mesh) -> MeshOut:
    """Called by a node with its node token (``Authorization: Bearer mnt_...``, from its join
        answer; no other token works here and this token works nowhere else). ``applied`` is the
        mesh generation it has applied, recorded as its acknowledgement (a release waits for it).
        Answers with its tenant's other nodes (public key, /32, endpoint), the hub, and the
        addresses its underlay guard admits WireGuard from, once the tenant's generation is newer
        than ``applied`` or after ``wait_s`` seconds. Never a peer of another tenant. A node token
    may hold a few waiting polls and the instance a bounded number (429 with Retry-After beyond;
    the acknowledgement is recorded all the same)."""
    b: MeshSync = req.body
    return MeshOut.model_validate(await nodes.sync(_bearer(req), b.applied, b.wait_s))
