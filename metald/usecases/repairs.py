"""The repair queue as the API drives it (``metald.repairs``): list, show, open by hand, take,
note, repaired; and ``RepairQueue``, the remediation workflow's way in.

Repairs are staff business: technicians and admins only. Every call checks the caller's role
again below the route's declaration, and a caller who is not staff is told a repair does not
exist (404), as a scoped token is for machines out of its scope. A technician cannot overrule
the rule that keeps a machine that failed commissioning twice after repair out of the pool:
opening a new repair for such a machine is an admin's decision (403 for a technician)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlmodel import Session, col, select

from metald import machines as machine_rows
from metald import repairs as svc
from metald.auth import Principal, Role
from metald.claims.workflow import ClaimWorkflow
from metald.errors import Forbidden, NotFound
from metald.inventory.normalize import NormalizedInventory
from metald.inventory.rules import profile_for
from metald.store.models import Machine, Repair, utcnow
from metald.usecases import Transactions
from metald.usecases.names import resolve
from metald.usecases.reads import Page, Pager, page

#: Newest first.
DEFAULT_ORDER = ["-opened_at", "id"]
_STAFF = frozenset({Role.ADMIN, Role.TECHNICIAN})


class RepairFilter(Protocol):
    """What the queue is narrowed by (``api.routes_repairs.RepairQuery``)."""

    status: str | None  # "open" (not closed: open, taken, verifying), "closed", or one status
    rack: str | None
    taken_by: str | None
    machine: str | None


def repair_view(r: Repair, m: Machine | None) -> dict[str, Any]:
    """A repair as the API shows it, with where its machine sits."""
    data: dict[str, Any] = r.model_dump(exclude={"open_machine_id"})
    data["machine"] = (
        None
        if m is None
        else {
            "id": m.id,
            "name": m.name,
            "state": m.state,
            "rack": m.rack,
            "rack_position": m.rack_position,
            "serial": m.serial,
            "last_error": m.last_error,
        }
    )
    data["actions"] = _actions(r, m)
    return data


def _actions(r: Repair, m: Machine | None) -> list[str]:
    if r.status == svc.Status.OPEN:
        return ["take", "note"]
    if r.status == svc.Status.TAKEN:
        return ["note", "repaired", "release"]
    if r.status == svc.Status.VERIFYING:
        return ["note"]
    return []


def _views(s: Session, rows: list[Repair]) -> list[dict[str, Any]]:
    ids = sorted({r.machine_id for r in rows})
    ms = {m.id: m for m in s.exec(select(Machine).where(col(Machine.id).in_(ids)))} if ids else {}
    return [repair_view(r, ms.get(r.machine_id)) for r in rows]


def _staff(p: Principal) -> None:
    if p.role not in _STAFF:
        raise NotFound("no such repair")


def _filtered(f: RepairFilter) -> Any:
    stmt = select(Repair)
    if f.status == "open":
        stmt = stmt.where(col(Repair.status).in_(sorted(svc.OPEN_STATUSES)))
    elif f.status:
        stmt = stmt.where(Repair.status == f.status)
    if f.rack or f.machine:
        stmt = stmt.join(Machine, Machine.id == Repair.machine_id)  # type: ignore[arg-type]
        if f.rack:
            stmt = stmt.where(Machine.rack == f.rack)
        if f.machine:
            stmt = stmt.where((Machine.id == f.machine) | (Machine.name == f.machine))
    if f.taken_by:
        stmt = stmt.where(Repair.taken_by == f.taken_by)
    return stmt


@dataclass
class RepairQueue:
    """What the remediation workflow hands a bad machine to (its ``RepairQueue`` Protocol):
    ``open`` in the caller's transaction (no commit), idempotent per remediation."""

    instance: str
    actor: str = "metald:remediation"
    #: remediation, or commissioning where a commissioning failure is handed over.
    source: svc.Source = svc.Source.REMEDIATION

    def open(
        self,
        session: Session,
        *,
        machine_id: str,
        remediation_id: str | None,
        faults: Sequence[Any],
    ) -> None:
        svc.open_repair(
            session,
            machine_id,
            faults=faults,
            source=self.source,
            actor=self.actor,
            remediation_id=remediation_id,
            instance=self.instance,
            commit=False,
        )


@dataclass
class Repairs:
    store: Transactions
    instance: str
    #: Wakes the live event streams after a commit.
    notify: Callable[[], None]
    #: enroll.rules: which commissioning profile a repaired machine's inventory gets.
    rules: Any
    #: The claim workflow: "repaired" boots the machine into its wipe or commissioning.
    workflow: ClaimWorkflow | None = None

    async def list(self, p: Principal, f: RepairFilter, pager: Pager) -> Page[dict[str, Any]]:
        """The queue, filtered, a page of it (newest first)."""
        _staff(p)
        return await self.store.read(
            lambda s: page(s, _filtered(f), Repair, pager, DEFAULT_ORDER, _views)
        )

    async def show(self, p: Principal, repair_id: str) -> dict[str, Any]:
        _staff(p)

        def run(s: Session) -> dict[str, Any]:
            r = svc.get(s, repair_id)
            return repair_view(r, s.get(Machine, r.machine_id))

        return await self.store.read(run)

    async def _write(self, fn: Callable[[Session], dict[str, Any]]) -> dict[str, Any]:
        try:
            return await self.store.run(fn)
        finally:
            self.notify()

    def _render(self, s: Session, repair_id: str) -> dict[str, Any]:
        r = svc.get(s, repair_id)
        return repair_view(r, s.get(Machine, r.machine_id))

    async def open(
        self, p: Principal, machine: str, *, summary: str, part: str | None, actor: str
    ) -> dict[str, Any]:
        """A technician puts a machine in the queue by hand (what ``mark-broken`` alone did,
        with the why and the part kept). A machine whose last repair ended ``out`` (failed
        commissioning twice after repair) is an admin's to reopen."""
        _staff(p)

        def run(s: Session) -> dict[str, Any]:
            mid = resolve(s, p, "machines", machine)
            if s.get(Machine, mid) is None:
                raise NotFound(f"no machine with id {machine!r}")
            last = svc.last_of(s, mid)
            if (
                last is not None
                and last.outcome == svc.Outcome.OUT
                and svc.open_of(s, mid) is None
                and p.role is not Role.ADMIN
            ):
                raise Forbidden(
                    f"machine {mid} failed commissioning twice after repair {last.id} and stays "
                    "out of the pool; only an admin can open a new repair for it (or retire it)"
                )
            fault = {
                "kind": "technician",
                "subject": part or "node",
                "code": "reported",
                "severity": "fatal",
                "witness": "technician",
                "evidence": summary,
                "first_seen": utcnow().isoformat(),
                "why": summary,
                "part": part,
            }
            r = svc.open_repair(
                s, mid, faults=[fault], source=svc.Source.TECHNICIAN, actor=actor,
                instance=self.instance,
            )  # fmt: skip
            return self._render(s, r.id)

        return await self._write(run)

    async def take(self, p: Principal, repair_id: str, *, actor: str) -> dict[str, Any]:
        _staff(p)

        def run(s: Session) -> dict[str, Any]:
            r = svc.take(s, repair_id, actor=actor, instance=self.instance)
            return self._render(s, r.id)

        return await self._write(run)

    async def release(self, p: Principal, repair_id: str, *, actor: str) -> dict[str, Any]:
        """Let go of a taken repair (``metald.repairs.release``): the one who took it, or an
        admin."""
        _staff(p)

        def run(s: Session) -> dict[str, Any]:
            r = svc.release(s, repair_id, actor=actor, admin=p.role is Role.ADMIN,
                            instance=self.instance)  # fmt: skip
            return self._render(s, r.id)

        return await self._write(run)

    async def note(self, p: Principal, repair_id: str, text: str, *, actor: str) -> dict[str, Any]:
        _staff(p)

        def run(s: Session) -> dict[str, Any]:
            r = svc.add_note(s, repair_id, text, actor=actor, instance=self.instance)
            return self._render(s, r.id)

        return await self._write(run)

    def _profile_of(self, m: Machine) -> Any:
        inv = (m.inventory or {}).get("normalized")
        if inv is None:
            return None
        return profile_for(self.rules, NormalizedInventory.model_validate(inv), m.rack_position)

    async def repaired(
        self, p: Principal, repair_id: str, *, note: str | None, actor: str
    ) -> dict[str, Any]:
        """The technician is done: the machine goes back through commissioning (wiped first
        when a tenant's data is still on its disks); the verdict closes the repair or puts it
        back in the queue (``metald.repairs.verification_ended``)."""
        _staff(p)
        assert self.workflow is not None, "Repairs built without its claim workflow"
        machine_id = await self.store.read(lambda s: svc.get(s, repair_id).machine_id)

        def mark(s: Session, m: Machine) -> object:
            return svc.mark_verifying(
                s, repair_id, m, actor=actor, note=note, instance=self.instance
            )

        try:
            return await self.workflow.verify_repair(
                machine_id,
                actor=actor,
                load=machine_rows.get_machine,
                render=lambda s, m: self._render(s, repair_id),
                profile_of=self._profile_of,
                mark=mark,
                reason=f"repaired by {actor} (repair {repair_id}): commissioning verifies it",
            )
        finally:
            self.notify()


__all__ = ["RepairQueue", "Repairs", "repair_view"]
