"""Firmware as the API shows and changes it: baselines per SKU profile (admins write, staff
read), the fleet's compliance with them, and updates of one machine through its BMC
(``metald.firmware``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlmodel import Session, col, select

from metald.auth import Principal
from metald.claims.allocation import Selector
from metald.errors import MetaldError, NotFound, Unprocessable
from metald.firmware import records
from metald.firmware.baselines import BaselineSpec
from metald.firmware.rollouts import RolloutConflict, rollout_event, rollout_view, targets_of
from metald.firmware.waves import InUse, Policy, RolloutState, TargetStatus
from metald.inventory.rules import EnrollmentRule
from metald.lifecycle import State
from metald.store.models import FirmwareRollout, FirmwareRolloutTarget, Machine, utcnow
from metald.usecases import Transactions
from metald.usecases.reads import Page, Pager, page_items

#: By profile, then machine id.
COMPLIANCE_ORDER = ["profile", "id"]


class FirmwareUpdater(Protocol):
    """The updates service (``metald.firmware.service.FirmwareUpdates``) as use cases see it."""

    async def start_update(
        self,
        machine_id: str,
        *,
        components: list[str] | None,
        actor: str,
        baseline_version: int | None = None,
    ) -> list[dict[str, Any]]: ...

    async def updates_of(self, machine_id: str) -> list[dict[str, Any]]: ...

    async def after_release(
        self, machine_ids: list[str], claim_id: str | None, actor: str
    ) -> list[str]: ...


class RolloutDriver(Protocol):
    """The rollouts service (``metald.firmware.rollouts.FirmwareRollouts``) as the API sees
    it: a daemon service woken when an admin changes a rollout."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def wake(self) -> None: ...


class UpdatesUnavailable(MetaldError):
    status = 503
    title = "Service unavailable"


@dataclass
class Firmware:
    store: Transactions
    instance: str
    rules: list[EnrollmentRule] = field(default_factory=list)
    updates: FirmwareUpdater | None = None

    async def put_baseline(
        self, p: Principal, profile: str, spec: BaselineSpec, *, note: str | None, actor: str
    ) -> dict[str, Any]:
        def run(s: Session) -> dict[str, Any]:
            row = records.add_baseline(
                s, profile, spec, note=note, actor=actor, instance=self.instance
            )
            return records.baseline_view(row)

        return await self.store.run(run)

    async def baselines(self, p: Principal, pager: Pager) -> Page[dict[str, Any]]:
        """The newest baseline of each profile."""

        def run(s: Session) -> Page[dict[str, Any]]:
            rows = sorted(records.latest(s).values(), key=lambda b: b.profile)
            return page_items(
                rows, pager, ["profile", "id"], lambda r: [records.baseline_view(b) for b in r]
            )

        return await self.store.read(run)

    async def baseline(self, p: Principal, profile: str) -> dict[str, Any]:
        """The profile's newest baseline and its earlier versions, newest first."""

        def run(s: Session) -> dict[str, Any]:
            rows = records.history(s, profile)
            if not rows:
                raise NotFound(
                    f"no firmware baseline for profile {profile!r}; an admin sets one with "
                    f"PUT /api/v1/firmware/baselines/{profile}"
                )
            out = records.baseline_view(rows[0])
            out["history"] = [
                {"version": b.version, "created_by": b.created_by, "created_at": b.created_at,
                 "note": b.note, "components": b.components}
                for b in rows[1:]
            ]  # fmt: skip
            return out

        return await self.store.read(run)

    async def compliance(
        self,
        p: Principal,
        pager: Pager,
        *,
        profile: str | None = None,
        include_compliant: bool = False,
    ) -> Page[dict[str, Any]]:
        """Machines whose profile has a baseline, each with the components off it (only the
        machines off baseline unless ``include_compliant``)."""

        def run(s: Session) -> Page[dict[str, Any]]:
            baselines = records.latest(s, profile)
            if not baselines:
                return Page([], 0, None)
            machines = s.exec(select(Machine).where(Machine.state != State.RETIRED.value)).all()
            found = records.compliance_of(self.rules, machines, baselines)
            views = [c.view() for c in found if include_compliant or not c.compliant]
            return page_items(
                views,
                pager,
                COMPLIANCE_ORDER,
                lambda rows: rows,
                get=lambda v, f: v["machine_id"] if f == "id" else v.get(f),
            )

        return await self.store.read(run)

    def _updater(self) -> FirmwareUpdater:
        if self.updates is None:
            raise UpdatesUnavailable(
                "this metald instance runs no firmware updates (it runs without BMC control); "
                "send the request to a metald daemon"
            )
        return self.updates

    async def update(
        self, p: Principal, machine_id: str, *, components: list[str] | None, actor: str
    ) -> list[dict[str, Any]]:
        """Flash the machine's components that are off its profile's baseline (or only those
        named) through its BMC, in the background."""
        return await self._updater().start_update(machine_id, components=components, actor=actor)

    async def updates_of(self, p: Principal, machine_id: str) -> list[dict[str, Any]]:
        return await self._updater().updates_of(machine_id)


#: The most machines one rollout takes.
MAX_ROLLOUT_TARGETS = 10_000
#: Admin actions on a rollout: (states it is allowed from, the state it goes to).
ROLLOUT_ACTIONS: dict[str, tuple[frozenset[RolloutState], RolloutState]] = {
    "pause": (frozenset({RolloutState.RUNNING}), RolloutState.PAUSED),
    "resume": (frozenset({RolloutState.PAUSED}), RolloutState.RUNNING),
    "abort": (frozenset({RolloutState.RUNNING, RolloutState.PAUSED}), RolloutState.ABORTED),
}


@dataclass(frozen=True)
class RolloutSpec:
    """What an admin asks of a rollout (validated by the API's schema)."""

    profile: str
    version: int
    selector: dict[str, Any]
    batch_size: int
    max_unavailable: int
    failure_budget: int
    in_use: str


@dataclass
class Rollouts:
    """Firmware rollouts across the fleet (``metald.firmware.rollouts``): admins start, pause,
    resume and abort them; staff read them. The targets are chosen here, once, with the claims'
    selector: the machines of the profile off the baseline version, not in another rollout."""

    store: Transactions
    instance: str
    rules: list[EnrollmentRule] = field(default_factory=list)
    wake: Callable[[], None] | None = None

    async def create(self, p: Principal, spec: RolloutSpec, *, actor: str) -> dict[str, Any]:
        selector = Selector.from_dict(spec.selector)
        policy = Policy(spec.batch_size, spec.max_unavailable, spec.failure_budget,
                        InUse(spec.in_use))  # fmt: skip

        def run(s: Session) -> dict[str, Any]:
            base = next(
                (b for b in records.history(s, spec.profile) if b.version == spec.version), None
            )
            if base is None:
                raise Unprocessable(
                    f"profile {spec.profile!r} has no firmware baseline version {spec.version}; "
                    "GET /api/v1/firmware/baselines/{profile} lists its versions"
                )
            busy = set(
                s.exec(
                    select(FirmwareRolloutTarget.machine_id)
                    .join(FirmwareRollout)
                    .where(col(FirmwareRollout.finished_at).is_(None))
                ).all()
            )
            machines = s.exec(
                select(Machine)
                .where(Machine.state != State.RETIRED.value)
                .order_by(col(Machine.rack), col(Machine.name), col(Machine.id))
            ).all()
            found = records.compliance_of(
                self.rules, [m for m in machines if selector.matches(m)], {spec.profile: base}
            )
            comps = records.components_of(base)
            targets = [
                c.machine.id
                for c in found
                if not c.compliant
                and c.machine.id not in busy
                and any(
                    f.status == "differs"
                    and (k := component_by_id(comps, f.component))
                    and k.updatable()
                    for f in c.findings
                )
            ]
            if not targets:
                raise RolloutConflict(
                    f"no machine to update: none that the selector matches is of profile "
                    f"{spec.profile} and off its baseline version {spec.version} with an image "
                    "to flash (or they are all in another rollout); GET "
                    "/api/v1/firmware/compliance shows which are off"
                )
            if len(targets) > MAX_ROLLOUT_TARGETS:
                raise Unprocessable(
                    f"{len(targets)} machines match; a rollout takes at most "
                    f"{MAX_ROLLOUT_TARGETS}: narrow the selector (rack, labels)"
                )
            r = FirmwareRollout(
                profile=spec.profile,
                baseline_version=spec.version,
                selector=selector.to_dict(),
                batch_size=policy.batch_size,
                max_unavailable=policy.max_unavailable,
                failure_budget=policy.failure_budget,
                in_use=policy.in_use.value,
                state=RolloutState.RUNNING.value,
                created_by=actor,
            )
            s.add(r)
            s.flush()
            rows = [
                FirmwareRolloutTarget(rollout_id=r.id, machine_id=mid, seq=i,
                                      status=TargetStatus.PENDING.value)
                for i, mid in enumerate(targets)
            ]  # fmt: skip
            s.add_all(rows)
            rollout_event(
                s, r, f"firmware rollout {r.id}: {len(rows)} machines of profile {spec.profile} "
                f"to baseline version {spec.version}, waves of {policy.batch_size}, at most "
                f"{policy.max_unavailable} at once, stopped after {policy.failure_budget} "
                f"failure(s), machines in use: {policy.in_use.value}",
                actor=actor, instance=self.instance, targets=rows, machines=targets[:100],
            )  # fmt: skip
            s.commit()
            return rollout_view(r, rows, with_targets=True)

        out = await self.store.run(run)
        self._wake()
        return out

    def _wake(self) -> None:
        if self.wake is not None:
            self.wake()

    async def list(self, p: Principal, pager: Pager) -> Page[dict[str, Any]]:
        def run(s: Session) -> Page[dict[str, Any]]:
            rows = s.exec(select(FirmwareRollout).order_by(col(FirmwareRollout.created_at).desc()))
            views = [rollout_view(r, targets_of(s, r.id)) for r in rows.all()]
            return page_items(views, pager, ["created_at", "id"], lambda v: v,
                              get=lambda v, f: v.get(f))  # fmt: skip

        return await self.store.read(run)

    async def get(self, p: Principal, rollout_id: str) -> dict[str, Any]:
        def run(s: Session) -> dict[str, Any]:
            r = _rollout(s, rollout_id)
            return rollout_view(r, targets_of(s, r.id), with_targets=True)

        return await self.store.read(run)

    async def act(
        self, p: Principal, rollout_id: str, action: str, *, actor: str
    ) -> dict[str, Any]:
        """Pause, resume or abort: recorded here, obeyed at the driver's next step (flashes
        under way finish: a flash is never cut off)."""
        allowed, to = ROLLOUT_ACTIONS[action]

        def run(s: Session) -> dict[str, Any]:
            r = _rollout(s, rollout_id, lock=True)
            if RolloutState(r.state) not in allowed:
                raise RolloutConflict(
                    f"rollout {rollout_id} is {r.state}: {action} applies to a rollout that is "
                    + " or ".join(sorted(a.value for a in allowed))
                )
            r.state, r.reason, r.updated_at = to.value, f"{action} by {actor}", utcnow()
            s.add(r)
            rows = targets_of(s, r.id)
            rollout_event(s, r, f"firmware rollout {r.id} {to.value} by {actor}", actor=actor,
                          instance=self.instance, targets=rows, action=action)  # fmt: skip
            s.commit()
            return rollout_view(r, rows, with_targets=True)

        out = await self.store.run(run)
        self._wake()
        return out


def _rollout(s: Session, rollout_id: str, *, lock: bool = False) -> FirmwareRollout:
    q = select(FirmwareRollout).where(FirmwareRollout.id == rollout_id)
    r = s.exec(q.with_for_update() if lock else q).first()
    if r is None:
        raise NotFound(
            f"no firmware rollout {rollout_id}; GET /api/v1/firmware/rollouts lists them"
        )
    return r


def component_by_id(comps: list[Any], cid: str) -> Any:
    return next((c for c in comps if c.id == cid), None)
