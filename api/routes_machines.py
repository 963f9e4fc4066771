"""/api/v1/machines: the fleet as technicians, orchestrators and agents see it."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func
from sqlmodel import Session, select

from api.routing import ALL_ROLES, STAFF, ApiRequest, Router
from api.schemas import (
    LabelsPatch,
    MachineAction,
    MachineCreate,
    MachineOut,
    MachinePage,
    MachineQuery,
    NicOut,
)
from metald import machines as svc
from metald import metrics
from metald.auth import Principal, Role, revoke_machine_tokens
from metald.errors import Conflict, NotFound
from metald.lifecycle import State, Trigger, allowed_triggers
from metald.store.models import Machine, Nic

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
        rows = s.exec(
            stmt.order_by(Machine.created_at.desc(), Machine.id).offset(q.offset).limit(limit)  # type: ignore[attr-defined]
        ).all()
        nics = _nics(s, [m.id for m in rows])
        return MachinePage(
            items=[machine_out(m, nics[m.id]) for m in rows],
            total=total,
            limit=limit,
            offset=q.offset,
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
    "/api/v1/machines/{id}/labels",
    summary="Edit a machine's labels",
    roles=STAFF,
    body=LabelsPatch,
    response=MachineOut,
    tag=TAG,
    errors=(404, 409, 422),
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
            expected_version=b.version,
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
            expected_version=b.version,
            updates=updates,
            instance=req.ctx.instance,
        )
        return machine_out(m, _nics(s, [m.id])[m.id])

    out = await req.write(run)
    metrics.transitions.labels(trigger.value).inc()
    return out


__all__ = ["router", "machine_out", "load_visible", "ACTIONS", "State"]
