"""/api/v1/machines: the fleet as technicians, orchestrators and agents see it; retrying and
wiping machines (``metald.claims.workflow``); tenant nodes' join tokens and hub peers.

BMC operations on a machine (power, boot device, sensors, log, approve) are in ``routes_bmc``
with the rest of the BMC subsystem's routes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints

from api import listing, workflows
from api.roles import JOIN_MINTERS
from api.routes_tenants import PeerOut
from api.routing import ALL_ROLES, STAFF, ApiRequest, Router
from api.schemas import (
    In,
    LabelsPatch,
    MachineAction,
    MachineCreate,
    MachineOut,
    MachinePage,
    MachinePatch,
    MachineQuery,
    Version,
)
from metald.lifecycle import State
from metald.usecases.join import Join
from metald.usecases.machines import ACTIONS, Machines

router = Router()
TAG = "machines"


#: What every technician's write to one machine declares: staff only, answers the machine,
#: honours If-Match, runs in the machines use case.
_TECHNICIAN_WRITE: dict[str, Any] = {
    "roles": STAFF,
    "response": MachineOut,
    "versioned": True,
    "use_case": workflows.machines,
    "tag": TAG,
    "errors": (404, 409, 422),
}


async def _change(
    req: ApiRequest, step: Callable[..., Awaitable[dict[str, Any]]], *args: Any, **kw: Any
) -> MachineOut:
    """One write of ``step`` to the path's machine, as the caller, conditional on the version
    the request names (``If-Match`` or the body's ``version``)."""
    out = await step(
        req.require_principal(),
        req.params["id"],
        *args,
        actor=req.actor,
        expected_version=req.expected_version(req.body.version),
        **kw,
    )
    return MachineOut.model_validate(out)


@router.route(
    "GET",
    "/api/v1/machines",
    summary="List machines",
    roles=ALL_ROLES,
    query=MachineQuery,
    response=MachinePage,
    tag=TAG,
    use_case=workflows.machines,
)
async def list_machines(req: ApiRequest, machines: Machines) -> MachinePage:
    """Machines visible to the caller, filtered and paginated (newest first)."""
    p = req.require_principal()
    return await listing.listed(
        req, MachinePage, lambda paging: machines.list(p, req.query, paging)
    )


@router.route(
    "POST",
    "/api/v1/machines",
    summary="Register a machine",
    roles=STAFF,
    body=MachineCreate,
    response=MachineOut,
    status=201,
    tag=TAG,
    errors=(409, 422),
    location="/api/v1/machines/{id}",
    use_case=workflows.machines,
)
async def create_machine(req: ApiRequest, machines: Machines) -> MachineOut:
    """Pre-register a machine by its MACs (machines that PXE-boot are registered on their own)."""
    b: MachineCreate = req.body
    m = await machines.create(
        actor=req.actor, macs=b.macs, name=b.name, labels=b.labels, rack=b.rack
    )
    return MachineOut.model_validate(m)


@router.route(
    "GET",
    "/api/v1/machines/{id}",
    summary="Show a machine",
    roles=ALL_ROLES,
    response=MachineOut,
    tag=TAG,
    errors=(404,),
    use_case=workflows.machines,
)
async def show_machine(req: ApiRequest, machines: Machines) -> MachineOut:
    """One machine with its NICs and full inventory."""
    return MachineOut.model_validate(await machines.show(req.require_principal(), req.params["id"]))


@router.route(
    "PATCH",
    "/api/v1/machines/{id}",
    summary="Rename a machine",
    body=MachinePatch,
    **_TECHNICIAN_WRITE,
)
async def patch_machine(req: ApiRequest, machines: Machines) -> MachineOut:
    """Set the machine's name (unique; every path that takes its id takes the name too) or
    rack. Fields left out are unchanged."""
    values = req.body.model_dump(exclude_unset=True, exclude={"version"})
    return await _change(req, machines.update, values)


@router.route(
    "PATCH",
    "/api/v1/machines/{id}/labels",
    summary="Edit a machine's labels",
    body=LabelsPatch,
    **_TECHNICIAN_WRITE,
)
async def patch_labels(req: ApiRequest, machines: Machines) -> MachineOut:
    """Merge-patch labels: a string value sets the label, null removes it."""
    return await _change(req, machines.patch_labels, req.body.labels)


@router.route(
    "POST",
    "/api/v1/machines/{id}/actions",
    summary="Act on a machine",
    body=MachineAction,
    **_TECHNICIAN_WRITE,
)
async def machine_action(req: ApiRequest, machines: Machines) -> MachineOut:
    """inspect, maintenance-on/off, mark-broken, repair, retire. Illegal in the current state: 409."""
    return await _change(req, machines.act, req.body.action, reason=req.body.reason)


__all__ = ["router", "ACTIONS", "State"]


# ---- operations: retry, wipe (metald.claims.workflow) ----------------------------------


class RetryIn(In):
    reason: Annotated[str, StringConstraints(max_length=500)] | None = None
    version: Version = None


class TechnicianNote(In):
    reason: Annotated[str, StringConstraints(min_length=1, max_length=500)]
    version: Version = None


@router.route(
    "POST",
    "/api/v1/machines/{id}/retry",
    summary="Retry a failed machine",
    body=RetryIn,
    **{**_TECHNICIAN_WRITE, "errors": (404, 409)},
)
async def retry_machine(req: ApiRequest, machines: Machines) -> MachineOut:
    """Start a failed operation again: provision-failed -> provisioning, wipe-failed -> wiping,
    inspect-failed -> inspecting, join-failed -> joining. Network-booting ones are power-cycled
    into PXE through their BMC. Any other state: 409."""
    return await _change(req, machines.retry, reason=req.body.reason)


@router.route(
    "POST",
    "/api/v1/machines/{id}/wipe",
    summary="Wipe a machine",
    body=RetryIn,
    **{**_TECHNICIAN_WRITE, "errors": (404, 409)},
)
async def wipe_machine(req: ApiRequest, machines: Machines) -> MachineOut:
    """Start a wipe of a machine in maintenance or wipe-failed (e.g. one marked broken during
    a claim, repaired, and owing a wipe): power-off, PXE and the wipe image through its BMC,
    then ready once the agent's evidence fits its recorded disks. Any other state: 409."""
    return await _change(req, machines.wipe, reason=req.body.reason)


@router.route(
    "POST",
    "/api/v1/machines/{id}/confirm-wipe",
    summary="Confirm a machine's disks were wiped",
    body=TechnicianNote,
    **_TECHNICIAN_WRITE,
)
async def confirm_wipe(req: ApiRequest, machines: Machines) -> MachineOut:
    """A technician vouches that the machine's disks were erased (by hand, or it has no BMC
    through which metald could boot its wipe image, or no disks the agent can see): from
    releasing, wiping, wipe-failed or maintenance to ready, detached from any tenant and claim.
    The reason is required and recorded with the technician's name (``machine.wipe-confirmed``
    event)."""
    return await _change(req, machines.confirm_wipe, reason=req.body.reason)


# ---- tenant nodes: join tokens and hub peers --------------------------------------------


class JoinTokenCreate(In):
    ttl_seconds: int = Field(default=1800, ge=60, le=86400)


class JoinTokenCreated(BaseModel):
    machine_id: str
    token: str
    expires_at: datetime


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
    use_case=workflows.join,
)
async def create_join_token(req: ApiRequest, join: Join) -> JoinTokenCreated:
    """A one-time, short-lived token for the machine's first-boot metadata. The secret is in
    this response and nowhere else. Admin, or the orchestrator of the machine's tenant; 409
    while the machine is on its hub (a join never replaces an active peer)."""
    b: JoinTokenCreate = req.body
    machine_id, secret, expires = await join.issue_token(
        req.require_principal(),
        req.params["id"],
        actor=req.actor,
        ttl=timedelta(seconds=b.ttl_seconds),
    )
    return JoinTokenCreated(machine_id=machine_id, token=secret, expires_at=expires)


@router.route(
    "DELETE",
    "/api/v1/machines/{id}/peer",
    summary="Revoke a node's place on its hub",
    roles=JOIN_MINTERS,
    response=PeerOut,
    tag="tenants",
    errors=(404,),
    use_case=workflows.join,
)
async def revoke_peer(req: ApiRequest, join: Join) -> PeerOut:
    """Take the machine's WireGuard peer off its tenant's hub (and revoke its unused join
    tokens), with a ``tenant.peer.removed`` event: the explicit step before a node may join
    again with a new key (a fresh seed and join token), since a join never replaces an active
    peer. Admin, or the orchestrator of the machine's tenant."""
    peer = await join.revoke_peer(req.require_principal(), req.params["id"], actor=req.actor)
    return PeerOut.model_validate(peer)
