"""Machines as the API shows and changes them: list, register, show, rename, labels (at most
``MAX_LABELS``), technician actions, and the operations of ``metald.claims.workflow`` (retry,
wipe, confirm a wipe) on the machines a caller may see.

A machine outside the caller's scope is reported as absent, not forbidden, so scoped tokens
cannot probe which ids exist."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import or_
from sqlmodel import Session, col, func, select

from metald import machines as svc
from metald import metrics, repairs
from metald.arch import AMD64
from metald.auth import Principal, Role, revoke_machine_tokens
from metald.claims.workflow import ClaimWorkflow
from metald.errors import Conflict, NotFound, Unprocessable
from metald.lifecycle import Trigger, allowed_triggers
from metald.store.models import Event, FirmwareUpdate, Machine, Nic
from metald.usecases import ID_SHAPED, Transactions
from metald.usecases.reads import Page, Pager, page

#: What each API action does, as lifecycle triggers. Technician actions only.
ACTIONS: dict[str, Trigger] = {
    "inspect": Trigger.INSPECT,
    "maintenance-on": Trigger.MAINTENANCE_ON,
    "maintenance-off": Trigger.MAINTENANCE_OFF,
    "mark-broken": Trigger.MARK_BROKEN,
    "repair": Trigger.REPAIR,
    "retire": Trigger.RETIRE,
}
#: The most labels one machine carries.
MAX_LABELS = 64
#: Newest first.
DEFAULT_ORDER = ["-created_at", "id"]


class MachineFilter(Protocol):
    """What a machine list is narrowed by (``api.schemas.MachineQuery``)."""

    state: Sequence[Any]  # lifecycle states (their ``value``)
    label: Sequence[str]  # "key=value", all must match
    gpu_model: str | None
    gpu_count: int | None
    min_gpu_count: int | None
    rack: str | None
    arch: str | None
    tenant_id: str | None


def machine_view(
    m: Machine, nics: list[Nic], *, with_inventory: bool = False, state_reason: str | None = None
) -> dict[str, Any]:
    """A machine as the API shows it: its fields, its NICs, the actions its state allows, and
    why it is in its state (the reason given when it entered it)."""
    # Not model_dump's inventory: it reads an unloaded (deferred) column as None, silently.
    data: dict[str, Any] = m.model_dump(exclude={"inventory"})
    data["labels"] = dict(m.labels or {})
    data["allowed_actions"] = [
        a for a, t in ACTIONS.items() if t.value in allowed_triggers(m.state)
    ]
    data["nics"] = [n.model_dump() for n in nics]
    data["inventory"] = m.inventory if with_inventory else None
    data["state_reason"] = state_reason
    return data


def state_reasons(session: Session, rows: Sequence[Machine]) -> dict[str, str | None]:
    """Each machine's reason for its current state: that of the latest transition event, when
    it led to the state the machine is in (one query for a page)."""
    ids = [m.id for m in rows]
    if not ids:
        return {}
    latest = (
        select(Event.machine_id, func.max(Event.id).label("last"))
        .where(col(Event.machine_id).in_(ids), col(Event.to_state).is_not(None))
        .group_by(col(Event.machine_id))
        .subquery()
    )
    stmt = select(Event.machine_id, Event.to_state, Event.reason).join(
        latest, col(Event.id) == latest.c.last
    )
    state = {m.id: m.state for m in rows}
    return {
        mid: reason
        for mid, to_state, reason in session.exec(stmt)
        if mid is not None and state.get(mid) == to_state
    }


def nics_of(session: Session, machine_ids: list[str]) -> dict[str, list[Nic]]:
    """Each machine's NICs, by MAC."""
    out: dict[str, list[Nic]] = {i: [] for i in machine_ids}
    if machine_ids:
        stmt = select(Nic).where(col(Nic.machine_id).in_(machine_ids)).order_by(col(Nic.mac))
        for n in session.exec(stmt):
            out[n.machine_id].append(n)
    return out


def view_of(session: Session, m: Machine, *, with_inventory: bool = False) -> dict[str, Any]:
    return machine_view(
        m,
        nics_of(session, [m.id])[m.id],
        with_inventory=with_inventory,
        state_reason=state_reasons(session, [m]).get(m.id),
    )


def _views(session: Session, rows: list[Machine]) -> list[dict[str, Any]]:
    nics = nics_of(session, [m.id for m in rows])
    why = state_reasons(session, rows)
    return [machine_view(m, nics[m.id], state_reason=why.get(m.id)) for m in rows]


def load_visible(session: Session, p: Principal, machine_id: str) -> Machine:
    """The machine, if the caller may see it; else NotFound (absent and out of scope alike)."""
    m = session.get(Machine, machine_id)
    if m is None or not p.can_see_machine(m.id, m.tenant_id):
        raise NotFound(f"no machine with id {machine_id!r}")
    return m


def merge_labels(current: dict[str, str] | None, patch: dict[str, str | None]) -> dict[str, str]:
    """A merge-patch of labels (a value sets, None removes); more than MAX_LABELS is a 409."""
    labels = dict(current or {})
    for k, v in patch.items():
        if v is None:
            labels.pop(k, None)
        else:
            labels[k] = v
    if len(labels) > MAX_LABELS:
        raise Conflict(f"a machine can carry at most {MAX_LABELS} labels")
    return labels


def _filtered(f: MachineFilter, p: Principal) -> Any:
    stmt = select(Machine)
    if f.state:
        stmt = stmt.where(col(Machine.state).in_([x.value for x in f.state]))
    for item in f.label:
        key, _, value = item.partition("=")
        stmt = stmt.where(Machine.labels[key].as_string() == value)  # type: ignore[attr-defined]
    if f.gpu_model:
        stmt = stmt.where(Machine.gpu_model == f.gpu_model)
    if f.gpu_count is not None:
        stmt = stmt.where(Machine.gpu_count == f.gpu_count)
    if f.min_gpu_count is not None:
        stmt = stmt.where(col(Machine.gpu_count) >= f.min_gpu_count)
    if f.rack:
        stmt = stmt.where(Machine.rack == f.rack)
    if f.arch == AMD64:
        stmt = stmt.where(or_(col(Machine.arch) == AMD64, col(Machine.arch).is_(None)))
    elif f.arch:
        stmt = stmt.where(Machine.arch == f.arch)
    if f.tenant_id:
        stmt = stmt.where(Machine.tenant_id == f.tenant_id)
    if p.role is Role.ORCHESTRATOR:
        stmt = stmt.where(col(Machine.tenant_id).in_(sorted(p.scope)))
    elif p.role is Role.AGENT:
        stmt = stmt.where(col(Machine.id).in_(sorted(p.scope)))
    return stmt


@dataclass
class Machines:
    store: Transactions
    instance: str
    #: Wakes the live event streams after a commit.
    notify: Callable[[], None]
    #: The claim workflow: retry, wipe and confirm-wipe boot through it.
    workflow: ClaimWorkflow | None = None

    async def list(self, p: Principal, f: MachineFilter, pager: Pager) -> Page[dict[str, Any]]:
        """The machines the caller may see that pass the filter, a page of them."""

        def run(s: Session) -> Page[dict[str, Any]]:
            return page(s, _filtered(f, p), Machine, pager, DEFAULT_ORDER, _views)

        return await self.store.run(run)

    async def show(self, p: Principal, machine_id: str) -> dict[str, Any]:
        """One machine with its NICs and full inventory."""
        return await self.store.run(
            lambda s: view_of(s, load_visible(s, p, machine_id), with_inventory=True)
        )

    async def _write(self, fn: Callable[[Session], dict[str, Any]]) -> dict[str, Any]:
        try:
            return await self.store.run(fn)
        finally:
            self.notify()  # every write records events

    async def create(
        self,
        *,
        actor: str,
        macs: Sequence[str],
        name: str | None,
        labels: dict[str, str],
        rack: str | None,
    ) -> dict[str, Any]:
        """Pre-register a machine by its MACs."""

        def run(s: Session) -> dict[str, Any]:
            m = svc.create_machine(
                s,
                macs=list(macs),
                actor=actor,
                name=name,
                labels=labels,
                rack=rack,
                instance=self.instance,
            )
            return view_of(s, m)

        return await self._write(run)

    async def update(
        self,
        p: Principal,
        machine_id: str,
        values: dict[str, Any],
        *,
        actor: str,
        expected_version: int | None,
    ) -> dict[str, Any]:
        """Set the machine's name (unique, never id-shaped) or rack; ``values`` holds only
        the fields to change."""

        def run(s: Session) -> dict[str, Any]:
            m = load_visible(s, p, machine_id)
            name = values.get("name")
            if name is not None and ID_SHAPED.fullmatch(name):
                raise Unprocessable("a name cannot look like an id (paths would read it as one)")
            if name is not None and name != m.name:
                other = s.exec(select(Machine).where(Machine.name == name)).first()
                if other is not None:
                    raise Conflict(
                        f"machine {other.id} is already named {name!r}; pick another name"
                    )
            # A rename that loses a race for the name after the check is the domain's 409.
            m = svc.update_fields(
                s,
                m.id,
                actor=actor,
                kind="machine.updated",
                values=values,
                expected_version=expected_version,
                data={"from": {k: getattr(m, k) for k in values}, "to": values},
                instance=self.instance,
            )
            return view_of(s, m)

        return await self._write(run)

    async def patch_labels(
        self,
        p: Principal,
        machine_id: str,
        patch: dict[str, str | None],
        *,
        actor: str,
        expected_version: int | None,
    ) -> dict[str, Any]:
        """Merge-patch the machine's labels (``merge_labels``: at most MAX_LABELS)."""

        def run(s: Session) -> dict[str, Any]:
            m = load_visible(s, p, machine_id)
            m = svc.update_fields(
                s,
                m.id,
                actor=actor,
                kind="machine.labels",
                values={"labels": merge_labels(m.labels, patch)},
                expected_version=expected_version,
                data={"patch": patch},
                instance=self.instance,
            )
            return view_of(s, m)

        return await self._write(run)

    async def act(
        self,
        p: Principal,
        machine_id: str,
        action: str,
        *,
        actor: str,
        reason: str | None,
        expected_version: int | None,
    ) -> dict[str, Any]:
        """A technician action (``ACTIONS``) as its lifecycle transition; illegal in the
        machine's state: 409."""
        trigger = ACTIONS[action]

        def run(s: Session) -> dict[str, Any]:
            m = load_visible(s, p, machine_id)
            repairs.check_manual(s, m.id, action, admin=p.role is Role.ADMIN)
            updates: dict[str, Any] = {}
            if trigger is Trigger.MAINTENANCE_OFF and m.inventory is None:
                raise Conflict(
                    f"machine {m.id} has never been inspected, so it cannot go straight to "
                    "ready; use the 'inspect' action instead"
                )
            if trigger in (Trigger.MAINTENANCE_OFF, Trigger.INSPECT, Trigger.RETIRE):
                busy = s.exec(
                    select(FirmwareUpdate.id).where(
                        FirmwareUpdate.machine_id == m.id,
                        col(FirmwareUpdate.phase).notin_(["done", "failed"]),
                    )
                ).first()
                if busy is not None:
                    raise Conflict(
                        f"machine {m.id} has a firmware update under way ({busy}); it stays "
                        "out of the pool until the update ends "
                        "(GET /api/v1/machines/{id}/firmware/updates)"
                    )
            if trigger is Trigger.INSPECT:
                updates["boot_intent"] = {"action": "inspect"}
            if trigger is Trigger.RETIRE:
                # A retired machine must not boot anything from us again.
                updates["boot_intent"] = {"action": "local"}
                revoke_machine_tokens(s, m.id, commit=False)
                repairs.retired(s, m, actor=actor, instance=self.instance)
            m = svc.transition(
                s,
                m.id,
                trigger,
                actor=actor,
                reason=reason,
                expected_version=expected_version,
                updates=updates,
                instance=self.instance,
            )
            return view_of(s, m)

        out = await self._write(run)
        metrics.transitions.labels(trigger.value).inc()
        return out

    # ---- operations of the claim workflow, on the machines the caller may see ----------

    def _operation(self, p: Principal, actor: str, what: str) -> dict[str, Any]:
        def load(s: Session, mid: str) -> Machine:
            m = load_visible(s, p, mid)
            repairs.check_manual(s, m.id, what, admin=p.role is Role.ADMIN)
            return m

        return {"actor": actor, "load": load, "render": view_of}

    def _workflow(self) -> ClaimWorkflow:
        assert self.workflow is not None, "Machines built without its claim workflow"
        return self.workflow

    async def retry(
        self, p: Principal, machine_id: str, *, actor: str, reason: str | None,
        expected_version: int | None,
    ) -> dict[str, Any]:  # fmt: skip
        """Start a failed operation again (``ClaimWorkflow.retry``)."""
        return await self._workflow().retry(
            machine_id,
            reason=reason,
            version=expected_version,
            **self._operation(p, actor, "retry"),
        )

    async def wipe(
        self, p: Principal, machine_id: str, *, actor: str, reason: str | None,
        expected_version: int | None,
    ) -> dict[str, Any]:  # fmt: skip
        """Start a wipe (``ClaimWorkflow.wipe``)."""
        return await self._workflow().wipe(
            machine_id,
            reason=reason,
            version=expected_version,
            **self._operation(p, actor, "wipe"),
        )

    async def confirm_wipe(
        self, p: Principal, machine_id: str, *, actor: str, reason: str,
        expected_version: int | None,
    ) -> dict[str, Any]:  # fmt: skip
        """A technician vouches for a wipe done by hand (``ClaimWorkflow.confirm_wipe``)."""
        return await self._workflow().confirm_wipe(
            machine_id,
            reason=reason,
            version=expected_version,
            **self._operation(p, actor, "confirm-wipe"),
        )
