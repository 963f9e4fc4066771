"""/api/v1/machines: the fleet as technicians, orchestrators and agents see it; retrying and
wiping machines (``metald.claims.workflow``); tenant nodes' join tokens and hub peers.

BMC operations on a machine (power, boot device, sensors, log, approve) are in ``routes_bmc``
with the rest of the BMC subsystem's routes."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta
from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints
from sqlalchemy import func
from sqlmodel import Session, select

from api.paging import page_rows
from api.resolve import FULL_ID
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
    NicOut,
    Version,
)
from api.workflows import claim_workflow
from metald import machines as svc
from metald import metrics
from metald.auth import Principal, Role, revoke_machine_tokens
from metald.errors import Conflict, NotFound, Unprocessable
from metald.lifecycle import State, Trigger, allowed_triggers
from metald.machines import get_machine
from metald.store.models import Machine, Nic
from metald.tenants import clusters

log = logging.getLogger("metald.tenants")
router = Router()
TAG = "machines"

#: What each API action does, as lifecycle triggers. Technician actions only.
ACTIONS: dict[str, Trigger] = {
    "inspect": Trigger.INSPECT,
    "maintenance-on": Trigger.MAINTENANCE_ON,
    "maintenance-off": Trigger.MAINTENANCE_OFF,
    "mark-broken": Trigger.MARK_BROKEN,
    "repair": Trigger.REPAIR,
    "retire": Trigger.RETIRE,
}


def machine_out(m: Machine, nics: list[Nic], *, with_inventory: bool = False) -> MachineOut:
    # Not model_dump's inventory: it reads an unloaded (deferred) column as None, silently.
    data: dict[str, Any] = m.model_dump(exclude={"inventory"})
    data["labels"] = dict(m.labels or {})
    data["allowed_actions"] = [
        a for a, t in ACTIONS.items() if t.value in allowed_triggers(m.state)
    ]
    data["nics"] = [NicOut.model_validate(n.model_dump()) for n in nics]
    data["inventory"] = m.inventory if with_inventory else None
    return MachineOut.model_validate(data)


def visible(p: Principal, m: Machine) -> bool:
    return p.can_see_machine(m.id, m.tenant_id)


def load_visible(session: Session, p: Principal, machine_id: str) -> Machine:
    m = session.get(Machine, machine_id)
    # A machine outside the caller's scope is reported as absent, not forbidden, so scoped
    # tokens cannot probe which ids exist.
    if m is None or not visible(p, m):
        raise NotFound(f"no machine with id {machine_id!r}")
    return m


def _nics(session: Session, machine_ids: list[str]) -> dict[str, list[Nic]]:
    out: dict[str, list[Nic]] = {i: [] for i in machine_ids}
    if machine_ids:
        for n in session.exec(select(Nic).where(Nic.machine_id.in_(machine_ids)).order_by(Nic.mac)):  # type: ignore[attr-defined]
            out[n.machine_id].append(n)
    return out


@router.route(
    "GET",
    "/api/v1/machines",
    summary="List machines",
    roles=ALL_ROLES,
    query=MachineQuery,
    response=MachinePage,
    tag=TAG,
)
async def list_machines(req: ApiRequest) -> MachinePage:
    """Machines visible to the caller, filtered and paginated (newest first)."""
    q: MachineQuery = req.query
    p = req.require_principal()
    limit = req.page_limit(q)

    def run(s: Session) -> MachinePage:
        stmt = select(Machine)
        if q.state:
            stmt = stmt.where(Machine.state.in_([x.value for x in q.state]))  # type: ignore[attr-defined]
        for item in q.label:
            key, _, value = item.partition("=")
            stmt = stmt.where(Machine.labels[key].as_string() == value)  # type: ignore[index]
        if q.gpu_model:
            stmt = stmt.where(Machine.gpu_model == q.gpu_model)
        if q.gpu_count is not None:
            stmt = stmt.where(Machine.gpu_count == q.gpu_count)
        if q.min_gpu_count is not None:
            stmt = stmt.where(Machine.gpu_count >= q.min_gpu_count)
        if q.rack:
            stmt = stmt.where(Machine.rack == q.rack)
        if q.tenant_id:
            stmt = stmt.where(Machine.tenant_id == q.tenant_id)
        if p.role is Role.ORCHESTRATOR:
            stmt = stmt.where(Machine.tenant_id.in_(sorted(p.scope)))  # type: ignore[union-attr]
        elif p.role is Role.AGENT:
            stmt = stmt.where(Machine.id.in_(sorted(p.scope)))  # type: ignore[attr-defined]
        total = s.exec(select(func.count()).select_from(stmt.subquery())).one()
        rows, cursor = page_rows(s, stmt, Machine, q, ["-created_at", "id"], limit)
        nics = _nics(s, [m.id for m in rows])
        return MachinePage(
            items=[machine_out(m, nics[m.id]) for m in rows],
            total=total,
            limit=limit,
            offset=q.offset,
            next=req.next_link(cursor),
        )

    return await req.ctx.store.run(run)


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
)
async def create_machine(req: ApiRequest) -> MachineOut:
    """Pre-register a machine by its MACs (machines that PXE-boot are registered on their own)."""
    b: MachineCreate = req.body

    def run(s: Session) -> MachineOut:
        m = svc.create_machine(
            s,
            macs=b.macs,
            actor=req.actor,
            name=b.name,
            labels=b.labels,
            rack=b.rack,
            instance=req.ctx.instance,
        )
        return machine_out(m, _nics(s, [m.id])[m.id])

    return await req.write(run)


@router.route(
    "GET",
    "/api/v1/machines/{id}",
    summary="Show a machine",
    roles=ALL_ROLES,
    response=MachineOut,
    tag=TAG,
    errors=(404,),
)
async def show_machine(req: ApiRequest) -> MachineOut:
    """One machine with its NICs and full inventory."""
    p = req.require_principal()

    def run(s: Session) -> MachineOut:
        m = load_visible(s, p, req.params["id"])
        return machine_out(m, _nics(s, [m.id])[m.id], with_inventory=True)

    return await req.ctx.store.run(run)


@router.route(
    "PATCH",
    "/api/v1/machines/{id}",
    summary="Rename a machine",
    roles=STAFF,
    body=MachinePatch,
    response=MachineOut,
    tag=TAG,
    errors=(404, 409, 422),
    versioned=True,
)
async def patch_machine(req: ApiRequest) -> MachineOut:
    """Set the machine's name (unique; every path that takes its id takes the name too) or
    rack. Fields left out are unchanged."""
    b: MachinePatch = req.body
    p = req.require_principal()
    values = b.model_dump(exclude_unset=True, exclude={"version"})

    def run(s: Session) -> MachineOut:
        m = load_visible(s, p, req.params["id"])
        name = values.get("name")
        if name is not None and FULL_ID.fullmatch(name):
            raise Unprocessable("a name cannot look like an id (paths would read it as one)")
        if name is not None and name != m.name:
            other = s.exec(select(Machine).where(Machine.name == name)).first()
            if other is not None:
                raise Conflict(f"machine {other.id} is already named {name!r}; pick another name")
        # A rename that loses a race for the name after the check is the domain's 409.
        m = svc.update_fields(
            s,
            m.id,
            actor=req.actor,
            kind="machine.updated",
            values=values,
            expected_version=req.expected_version(b.version),
            data={"from": {k: getattr(m, k) for k in values}, "to": values},
            instance=req.ctx.instance,
        )
        return machine_out(m, _nics(s, [m.id])[m.id])

    return await req.write(run)


@router.route(
    "PATCH",
    "/api/v1/machines/{id}/labels",
    summary="Edit a machine's labels",
    roles=STAFF,
    body=LabelsPatch,
    response=MachineOut,
    tag=TAG,
    errors=(404, 409, 422),
    versioned=True,
)
async def patch_labels(req: ApiRequest) -> MachineOut:
    """Merge-patch labels: a string value sets the label, null removes it."""
    b: LabelsPatch = req.body
    p = req.require_principal()

    def run(s: Session) -> MachineOut:
        m = load_visible(s, p, req.params["id"])
        labels = dict(m.labels or {})
        for k, v in b.labels.items():
            if v is None:
                labels.pop(k, None)
            else:
                labels[k] = v
        if len(labels) > 64:
            raise Conflict("a machine can carry at most 64 labels")
        m = svc.update_fields(
            s,
            m.id,
            actor=req.actor,
            kind="machine.labels",
            values={"labels": labels},
            expected_version=req.expected_version(b.version),
            data={"patch": b.labels},
            instance=req.ctx.instance,
        )
        return machine_out(m, _nics(s, [m.id])[m.id])

    return await req.write(run)


@router.route(
    "POST",
    "/api/v1/machines/{id}/actions",
    summary="Act on a machine",
    roles=STAFF,
    body=MachineAction,
    response=MachineOut,
    tag=TAG,
    errors=(404, 409, 422),
    versioned=True,
)
async def machine_action(req: ApiRequest) -> MachineOut:
    """inspect, maintenance-on/off, mark-broken, repair, retire. Illegal in the current state: 409."""
    b: MachineAction = req.body
    p = req.require_principal()
    trigger = ACTIONS[b.action]

    def run(s: Session) -> MachineOut:
        m = load_visible(s, p, req.params["id"])
        updates: dict[str, Any] = {}
        if trigger is Trigger.MAINTENANCE_OFF and m.inventory is None:
            raise Conflict(
                f"machine {m.id} has never been inspected, so it cannot go straight to ready; "
                "use the 'inspect' action instead"
            )
        if trigger is Trigger.INSPECT:
            updates["boot_intent"] = {"action": "inspect"}
        if trigger is Trigger.RETIRE:
            # A retired machine must not boot anything from us again.
            updates["boot_intent"] = {"action": "local"}
            revoke_machine_tokens(s, m.id, commit=False)
        m = svc.transition(
            s,
            m.id,
            trigger,
            actor=req.actor,
            reason=b.reason,
            expected_version=req.expected_version(b.version),
            updates=updates,
            instance=req.ctx.instance,
        )
        return machine_out(m, _nics(s, [m.id])[m.id])

    out = await req.write(run)
    metrics.transitions.labels(trigger.value).inc()
    return out


__all__ = ["router", "machine_out", "load_visible", "ACTIONS", "State"]


# ---- operations: retry, wipe (metald.claims.workflow) ----------------------------------


class RetryIn(In):
    reason: Annotated[str, StringConstraints(max_length=500)] | None = None
    version: Version = None


class TechnicianNote(In):
    reason: Annotated[str, StringConstraints(min_length=1, max_length=500)]
    version: Version = None


def _as_caller(req: ApiRequest) -> dict[str, Any]:
    """How a machine step of the workflow acts for this request: as its actor, on machines
    its token may see, answering with the machine as the API shows it."""
    p = req.require_principal()
    return {
        "actor": req.actor,
        "load": lambda s, mid: load_visible(s, p, mid),
        "render": _machine_view,
    }


def _machine_view(s: Session, m: Machine) -> MachineOut:
    return machine_out(m, list(s.exec(select(Nic).where(Nic.machine_id == m.id)).all()))


@router.route(
    "POST",
    "/api/v1/machines/{id}/retry",
    summary="Retry a failed machine",
    roles=STAFF,
    body=RetryIn,
    response=MachineOut,
    tag="machines",
    errors=(404, 409),
    versioned=True,
)
async def retry_machine(req: ApiRequest) -> MachineOut:
    """Start a failed operation again: provision-failed -> provisioning, wipe-failed -> wiping,
    inspect-failed -> inspecting, join-failed -> joining. Network-booting ones are power-cycled
    into PXE through their BMC. Any other state: 409."""
    b: RetryIn = req.body
    return await claim_workflow(req.ctx).retry(
        req.params["id"],
        reason=b.reason,
        version=req.expected_version(b.version),
        **_as_caller(req),
    )


@router.route(
    "POST",
    "/api/v1/machines/{id}/wipe",
    summary="Wipe a machine",
    roles=STAFF,
    body=RetryIn,
    response=MachineOut,
    tag="machines",
    errors=(404, 409),
    versioned=True,
)
async def wipe_machine(req: ApiRequest) -> MachineOut:
    """Start a wipe of a machine in maintenance or wipe-failed (e.g. one marked broken during
    a claim, repaired, and owing a wipe): power-off, PXE and the wipe image through its BMC,
    then ready once the agent's evidence fits its recorded disks. Any other state: 409."""
    b: RetryIn = req.body
    return await claim_workflow(req.ctx).wipe(
        req.params["id"],
        reason=b.reason,
        version=req.expected_version(b.version),
        **_as_caller(req),
    )


@router.route(
    "POST",
    "/api/v1/machines/{id}/confirm-wipe",
    summary="Confirm a machine's disks were wiped",
    roles=STAFF,
    body=TechnicianNote,
    response=MachineOut,
    tag="machines",
    errors=(404, 409, 422),
    versioned=True,
)
async def confirm_wipe(req: ApiRequest) -> MachineOut:
    """A technician vouches that the machine's disks were erased (by hand, or it has no BMC
    through which metald could boot its wipe image, or no disks the agent can see): from
    releasing, wiping, wipe-failed or maintenance to ready, detached from any tenant and claim.
    The reason is required and recorded with the technician's name (``machine.wipe-confirmed``
    event)."""
    b: TechnicianNote = req.body
    return await claim_workflow(req.ctx).confirm_wipe(
        req.params["id"],
        reason=b.reason,
        version=req.expected_version(b.version),
        **_as_caller(req),
    )


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
        secret, expires = clusters.issue_join_token(
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
        peer = clusters.remove_peer(
            s, m.id, actor=req.actor, instance=req.ctx.instance, reason="revoked"
        )
        if peer is None:
            raise NotFound(f"machine {m.id} has no peer on a tenant's hub")
        s.commit()
        return PeerOut.model_validate(peer.model_dump()), peer.tenant_id

    out, tenant_id = await req.write(run)
    req.ctx.services.mesh_watch.changed(tenant_id)
    hubs = req.ctx.services.tenant_hubs
    if hubs is not None:  # else the hub drops it when it next syncs with the store
        try:
            await asyncio.to_thread(hubs.remove_peer, tenant_id, out.public_key)
        except Exception:
            log.exception("could not take machine %s's peer off its hub", out.machine_id)
    return out
