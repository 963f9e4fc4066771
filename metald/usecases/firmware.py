"""Firmware as the API shows and changes it: baselines per SKU profile (admins write, staff
read), the fleet's compliance with them, and updates of one machine through its BMC
(``metald.firmware``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlmodel import Session, select

from metald.auth import Principal
from metald.errors import MetaldError, NotFound
from metald.firmware import records
from metald.firmware.baselines import BaselineSpec
from metald.inventory.rules import EnrollmentRule
from metald.lifecycle import State
from metald.store.models import Machine
from metald.usecases import Transactions
from metald.usecases.reads import Page, Pager, page_items

#: By profile, then machine id.
COMPLIANCE_ORDER = ["profile", "id"]


class FirmwareUpdater(Protocol):
    """The updates service (``metald.firmware.service.FirmwareUpdates``) as use cases see it."""

    async def start_update(
        self, machine_id: str, *, components: list[str] | None, actor: str
    ) -> list[dict[str, Any]]: ...

    async def updates_of(self, machine_id: str) -> list[dict[str, Any]]: ...

    async def after_release(
        self, machine_ids: list[str], claim_id: str | None, actor: str
    ) -> list[str]: ...


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
