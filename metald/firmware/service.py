"""Firmware updates as a daemon service: each update of a machine runs in this service's
``TaskScope`` through the BMC's fenced executor, one component after another, following the
step table (``metald.firmware.updates``).

Its phase is written to the store (``firmware_updates``) before each step is taken, so
whichever instance owns the BMC next resumes it from there (``resume``, at start and whenever
the fleet's live set changes): an offer cut off is looked for among the BMC's tasks, never
sent again; while an update is ``offering`` or ``flashing`` the executor refuses power
commands to the host (``metald.bmc.ownership.check_and_journal``). Every phase change is a
``firmware.update`` event; the version read back is recorded on the machine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlmodel import Session, col, select

from metald.bmc import chassis
from metald.bmc import firmware as bmc_firmware
from metald.bmc.base import PowerAction, PowerState, UpdateTask
from metald.bmc.capabilities import Capability
from metald.bmc.control import BmcCommandFailed, Executor, NotOwner
from metald.config import FirmwareConfig
from metald.errors import Conflict, MetaldError, NotFound, Unprocessable
from metald.firmware import records, release
from metald.firmware.baselines import Component, component_for
from metald.firmware.images import FirmwareImages
from metald.firmware.updates import OPEN, Action, Decision, Event, Phase, decide
from metald.inventory.rules import EnrollmentRule
from metald.lifecycle import HELD, State
from metald.machines import add_event, get_machine
from metald.service import TaskScope
from metald.store.db import Store
from metald.store.models import Bmc, FirmwareUpdate, utcnow

log = logging.getLogger(__name__)
#: Steps kept in an update's journal.
MAX_JOURNAL = 64
#: States a machine may be updated in: out of the pool, so nobody claims it meanwhile.
UPDATABLE_STATES = frozenset(s.value for s in HELD)
#: Where a release's re-flash runs: released, before its wipe boots (nobody claims it).
RELEASE_STATES = UPDATABLE_STATES | {State.RELEASING.value}


def update_view(u: FirmwareUpdate) -> dict[str, Any]:
    return u.model_dump()


class UpdateConflict(Conflict):
    title = "Firmware update not possible now"


@dataclass
class _Run:
    """What one update's run knows besides its row: deadlines and what it read last."""

    phase_since: float
    task: UpdateTask | None = None
    detail: str = ""
    #: The host was off before the apply step powered it on: it is turned off again after.
    power_off_after: bool = False


class FirmwareUpdates:
    name = "firmware"

    def __init__(
        self,
        store: Store,
        executor: Executor,
        images: FirmwareImages,
        cfg: FirmwareConfig,
        instance: str,
        *,
        rules: Callable[[], list[EnrollmentRule]],
        boot_url: str | None,
        tasks: TaskScope | None = None,
        notify: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.ex = executor
        self.images = images
        self.cfg = cfg
        self.instance = instance
        self.actor = f"metald:{instance}"
        self.rules = rules
        #: The boot HTTP listener's URL, where BMCs pull images (None: push only).
        self.boot_url = boot_url.rstrip("/") if boot_url else None
        self.tasks = tasks if tasks is not None else TaskScope(self.name)
        self.notify = notify
        #: Machines whose updates run in this instance now.
        self.running: set[str] = set()
        #: Called when a machine's updates ended (a rollout's driver is woken).
        self.on_end: Callable[[], None] = lambda: None

    # --- lifecycle ---

    async def start(self) -> None:
        await self.tasks.open()
        await self.resume()

    async def stop(self) -> None:
        await self.tasks.close()

    def wake(self) -> None:
        """The fleet's live set changed: pick up updates of BMCs this instance now owns."""
        self.tasks.start_soon(self.resume(), name="firmware-resume")

    def health(self) -> str:
        return f"running ({len(self.running)} machines updating)"

    # --- the API's side ---

    async def updates_of(self, machine_id: str) -> list[dict[str, Any]]:
        def run(s: Session) -> list[dict[str, Any]]:
            get_machine(s, machine_id)
            rows = s.exec(
                select(FirmwareUpdate)
                .where(FirmwareUpdate.machine_id == machine_id)
                .order_by(col(FirmwareUpdate.created_at).desc())
                .limit(50)
            ).all()
            return [update_view(u) for u in rows]

        return await self.store.run(run)

    async def start_update(
        self,
        machine_id: str,
        *,
        components: list[str] | None,
        actor: str,
        baseline_version: int | None = None,
        states: frozenset[str] = UPDATABLE_STATES,
    ) -> list[dict[str, Any]]:
        """Queue an update of every updatable component of the machine that is off its
        profile's baseline (its newest version, or ``baseline_version``: a rollout's) or only
        those named, and start it in the background (``states``: where the machine may be;
        a release's re-flash adds ``releasing``)."""
        row = await self.ex.row_for_machine(machine_id)
        self.ex.require(
            row,
            Capability.FIRMWARE_UPDATE,
            "IPMI has no standard way to update firmware; register the machine's Redfish BMC "
            "(POST /api/v1/bmcs with protocol redfish) to update it through metald",
        )
        rules = self.rules()

        def queue(s: Session) -> list[dict[str, Any]]:
            m = get_machine(s, machine_id)
            if m.state not in states:
                raise UpdateConflict(
                    f"machine {machine_id} is {m.state}: put it in maintenance first (POST "
                    f"/api/v1/machines/{machine_id}/actions "
                    '{"action": "maintenance-on"}) so that nobody claims it while its firmware '
                    "is updated"
                )
            busy = s.exec(
                select(FirmwareUpdate.id).where(
                    FirmwareUpdate.machine_id == machine_id,
                    col(FirmwareUpdate.phase).in_([p.value for p in OPEN]),
                )
            ).first()
            if busy is not None:
                raise UpdateConflict(
                    f"machine {machine_id} has a firmware update under way ({busy}); wait for "
                    "it to end (GET .../firmware/updates)"
                )
            profile = records.machine_profile(rules, m)
            baseline = records.latest(s, profile).get(profile) if profile else None
            if profile is not None and baseline_version is not None:
                baseline = next(
                    (b for b in records.history(s, profile) if b.version == baseline_version),
                    None,
                )
            if profile is None or baseline is None:
                raise Unprocessable(
                    f"machine {machine_id} has no firmware baseline: "
                    + (
                        "its inventory matches no enroll rule with a commissioning profile"
                        if profile is None
                        else f"set one for profile {profile} "
                        f"(PUT /api/v1/firmware/baselines/{profile})"
                    )
                )
            comps = records.components_of(baseline)
            plan = _plan(comps, m.firmware_versions or {}, components)
            if not plan:
                raise UpdateConflict(
                    f"nothing to update on machine {machine_id}: every component metald can "
                    f"flash is at profile {profile}'s baseline version {baseline.version} "
                    "(as last read; GET .../firmware reads the BMC again)"
                )
            out = []
            for item, comp, have in plan:
                assert comp.sha256 is not None
                u = FirmwareUpdate(
                    machine_id=machine_id,
                    bmc_id=row.id,
                    profile=profile,
                    baseline_version=baseline.version,
                    component=comp.id,
                    item=item,
                    version_before=have,
                    version=comp.version,
                    sha256=comp.sha256,
                    apply=comp.apply,
                    phase=Phase.QUEUED.value,
                    requested_by=actor,
                    journal=[{"step": "queued", "at": utcnow().isoformat()}],
                )
                s.add(u)
                out.append(u)
            add_event(
                s,
                "firmware.update-requested",
                actor,
                machine_id=machine_id,
                instance=self.instance,
                reason=f"update to profile {profile}'s baseline version {baseline.version}: "
                + ", ".join(f"{u.item} {u.version_before} -> {u.version}" for u in out),
                data={"updates": [u.id for u in out]},
            )
            s.commit()
            return [update_view(u) for u in out]

        views = await self.store.run(queue)
        self.notify()
        self._spawn(machine_id)
        return views

    # --- release ---

    async def after_release(
        self, machine_ids: list[str], claim_id: str | None, actor: str
    ) -> list[str]:
        """Restore released machines' BMCs before their wipe (``metald.firmware.release``);
        the ids of the machines held instead of wiped."""
        if not self.cfg.clean_on_release:
            return []
        held = []
        reflash: dict[str, list[str]] = {}
        for mid in machine_ids:
            try:
                out = await release.clean(
                    self.ex,
                    mid,
                    claim_id,
                    keep_accounts=list(self.cfg.keep_accounts),
                    rules=self.rules(),
                    actor=actor,
                )
            except NotOwner as e:  # its owner's own release path is not this one: wipe as before
                log.warning("machine %s: release clean-up left undone: %s", mid, e)
                continue
            if out.hold and not out.skipped:
                held.append(mid)
            elif out.reflash:
                reflash[mid] = out.reflash
        self.notify()
        if reflash:
            held += await self._reflash(reflash, claim_id, actor)
        return held

    async def _reflash(
        self, items: dict[str, list[str]], claim_id: str | None, actor: str
    ) -> list[str]:
        """Flash the items a tenant changed back to the baseline, machine by machine in
        parallel, and wait for every update to end: a machine whose re-flash failed is held in
        the repair queue with the updates' errors; the others go on to their wipe. The ids of
        the machines held."""
        started: dict[str, list[str]] = {}
        held: list[str] = []
        for mid, only in items.items():
            try:
                views = await self.start_update(
                    mid, components=only, actor=actor, states=RELEASE_STATES
                )
                started[mid] = [v["id"] for v in views]
            except MetaldError as e:
                await self.store.run(_release_reflashed, mid, claim_id, [], e.detail, actor,
                                     self.instance)  # fmt: skip
                held.append(mid)
        limit = self.cfg.flash_timeout_s + self.cfg.verify_timeout_s + 120
        end = time.monotonic() + limit
        while started:
            ended = await self.store.read(
                _ended_updates, [u for us in started.values() for u in us]
            )
            for mid, ids in list(started.items()):
                if not all(i in ended for i in ids):
                    continue
                del started[mid]
                rows = [ended[i] for i in ids]
                failed = [u for u in rows if u.phase == Phase.FAILED.value]
                err = "; ".join(f"{u.item}: {u.error}" for u in failed) or None
                await self.store.run(_release_reflashed, mid, claim_id, rows, err, actor,
                                     self.instance)  # fmt: skip
                if failed:
                    held.append(mid)
            if not started:
                break
            if time.monotonic() > end:
                for mid in started:  # the updates' own deadlines end them first; never here
                    await self.store.run(_release_reflashed, mid, claim_id, [],
                                         f"the re-flash did not end within {limit:.0f} s",
                                         actor, self.instance)  # fmt: skip
                    held.append(mid)
                break
            await asyncio.sleep(self.cfg.poll_s)
        self.notify()
        return held

    # --- resuming ---

    async def resume(self) -> list[str]:
        """Start the open updates of machines whose BMC this instance owns."""

        def open_updates(s: Session) -> list[tuple[str, str]]:
            q = (
                select(FirmwareUpdate.machine_id, Bmc.address)
                .join(Bmc, col(Bmc.id) == FirmwareUpdate.bmc_id)
                .where(col(FirmwareUpdate.phase).in_([p.value for p in OPEN]))
                .distinct()
            )
            return [(m, a) for m, a in s.exec(q).all()]

        own = getattr(self.ex, "ownership", None)
        started = []
        for machine_id, _address in await self.store.run(open_updates):
            if machine_id in self.running:
                continue
            try:
                row = await self.ex.row_for_machine(machine_id)
            except MetaldError as e:  # its BMC was removed meanwhile: nothing can resume it
                log.warning("machine %s: firmware update not resumed: %s", machine_id, e)
                continue
            if own is not None and not own.owns_bmc(row.id, row.address):
                continue
            log.warning("machine %s: resuming its firmware update", machine_id)
            self._spawn(machine_id, resumed=True)
            started.append(machine_id)
        return started

    def _spawn(self, machine_id: str, resumed: bool = False) -> None:
        if machine_id in self.running:
            return
        self.running.add(machine_id)
        self.tasks.start_soon(self._machine(machine_id, resumed), name=f"firmware-{machine_id}")

    async def _machine(self, machine_id: str, resumed: bool) -> None:
        """The machine's open updates, one after another (one flash at a time per BMC)."""
        try:
            while True:
                u = await self.store.run(_next_open, machine_id)
                if u is None:
                    return
                ok = await self._update(u, resumed=resumed or u.phase != Phase.QUEUED.value)
                if not ok:
                    await self.store.run(_fail_rest, machine_id, u.id, self.actor, self.instance)
                    return
        except NotOwner as e:
            log.warning("machine %s: firmware update left to the BMC's owner: %s", machine_id, e)
        finally:
            self.running.discard(machine_id)
            self.notify()
            self.on_end()

    # --- one update, step by step ---

    async def _update(self, u: FirmwareUpdate, *, resumed: bool) -> bool:
        """Run one update to its end; True when done."""
        phase = Phase(u.phase)
        d = decide(phase, Event.RESUME if resumed else Event.START, apply=u.apply)
        run = _Run(time.monotonic())
        while True:
            if d.phase != phase or d.reason:
                await self._record(u, d, run)
                if d.phase != phase:
                    run.phase_since = time.monotonic()
                phase = d.phase
            if d.action is Action.STOP:
                return phase is Phase.DONE
            d = await self._act(u, phase, d, run)

    async def _act(self, u: FirmwareUpdate, phase: Phase, d: Decision, run: _Run) -> Decision:
        row = await self.ex.row_for_machine(u.machine_id)
        late = time.monotonic() - run.phase_since
        if d.action is Action.OFFER:
            return await self._offer(u, row, phase, run)
        if d.action is Action.FIND_TASK:
            try:
                found = await self.ex.execute(
                    row,
                    Capability.FIRMWARE_UPDATE,
                    "find_update_task",
                    lambda drv: drv.find_update_task(u.id),
                )
            except BmcCommandFailed as e:
                if late > self.cfg.flash_timeout_s:
                    return decide(phase, Event.TIMEOUT, detail=e.detail)
                await asyncio.sleep(self.cfg.poll_s)
                return d
            if found is None:
                return decide(phase, Event.TASK_MISSING)
            run.task = found
            return decide(phase, Event.TASK_FOUND)
        if d.action is Action.POLL_TASK:
            return await self._poll(u, row, phase, d, run, late)
        if d.action is Action.APPLY:
            try:
                await self._apply(u, row, run)
            except (BmcCommandFailed, Unprocessable) as e:
                if late > self.cfg.verify_timeout_s:
                    return decide(phase, Event.TIMEOUT, detail=e.detail)
                await asyncio.sleep(self.cfg.poll_s)
                return d
            return decide(phase, Event.APPLIED)
        if d.action is Action.READ_VERSION:
            return await self._verify(u, phase, d, run, late)
        raise AssertionError(d)

    async def _offer(self, u: FirmwareUpdate, row: Bmc, phase: Phase, run: _Run) -> Decision:
        comp = await self.store.run(_component_of, u)
        if comp is None or comp.url is None:
            return decide(
                Phase.QUEUED, Event.REFUSED, detail="the baseline no longer names an image for it"
            )
        try:
            path = await self.images.ensure(comp.url, u.sha256)
            methods: frozenset[str] = await self.ex.execute(
                row, Capability.FIRMWARE_UPDATE, "update_methods", lambda d: d.update_methods()
            )
        except (MetaldError, BmcCommandFailed) as e:
            return decide(Phase.QUEUED, Event.REFUSED, detail=e.detail)
        # Recorded as offered before it is sent: a cut-off offer is looked for, never resent.
        pull = "simple-update" in methods and self.boot_url is not None
        transfer = "simple-update" if pull else "multipart"
        await self.store.run(_mark_offering, u.id, transfer)
        u.phase, u.transfer = Phase.OFFERING.value, transfer
        try:
            if pull:
                url = f"{self.boot_url}/boot/firmware/{u.sha256}.bin?update={u.id}"
                task = await self.ex.execute(
                    row,
                    Capability.FIRMWARE_UPDATE,
                    "simple_update",
                    lambda d: d.simple_update(url, u.item),
                    write=True,
                    idempotent=False,
                )
            else:
                image = await asyncio.to_thread(path.read_bytes)
                task = await self.ex.execute(
                    row,
                    Capability.FIRMWARE_UPDATE,
                    "push_update",
                    lambda d: d.push_update(image, u.item, u.id),
                    write=True,
                    idempotent=False,
                    timeout_s=self.ex.cfg.timeout_s + len(image) / 1_000_000,
                )
        except Unprocessable as e:
            return decide(Phase.OFFERING, Event.REFUSED, detail=e.detail)
        except BmcCommandFailed:
            # No answer: it may have reached the BMC. Look for its task, as after a crash.
            return decide(Phase.OFFERING, Event.RESUME)
        run.task = task
        return decide(Phase.OFFERING, Event.OFFERED)

    async def _poll(
        self, u: FirmwareUpdate, row: Bmc, phase: Phase, d: Decision, run: _Run, late: float
    ) -> Decision:
        if run.task is None and u.task_uri:
            run.task = UpdateTask(u.task_uri, "Unknown", u.percent)  # recorded: read it again
        if run.task is None:
            found = await self.ex.execute(
                row,
                Capability.FIRMWARE_UPDATE,
                "find_update_task",
                lambda drv: drv.find_update_task(u.id),
            )
            if found is None:
                return decide(phase, Event.TASK_GONE)
            run.task = found
        uri = run.task.uri
        try:
            task: UpdateTask = await self.ex.execute(
                row, Capability.FIRMWARE_UPDATE, "update_task", lambda drv: drv.update_task(uri)
            )
        except Unprocessable:
            return decide(phase, Event.TASK_GONE)
        except BmcCommandFailed as e:  # a BMC restarting mid-flash answers nothing for a while
            if late > self.cfg.flash_timeout_s:
                return decide(phase, Event.TIMEOUT, detail=e.detail)
            await asyncio.sleep(self.cfg.poll_s)
            return d
        if task.percent != (run.task.percent if run.task else None) or task.uri != u.task_uri:
            await self.store.run(_progress, u.id, task.uri, task.percent)
            self.notify()
        run.task = task
        if not task.done:
            if late > self.cfg.flash_timeout_s:
                return decide(phase, Event.TIMEOUT, detail=f"still {task.state} at {task.percent}%")
            await asyncio.sleep(self.cfg.poll_s)
            return decide(phase, Event.TASK_RUNNING)
        words = "; ".join(task.messages[-2:])
        if task.ok:
            run.detail = words
            return decide(phase, Event.TASK_COMPLETED, apply=u.apply)
        return decide(
            phase, Event.TASK_FAILED, detail=f"{task.state}: {words}" if words else task.state
        )

    async def _apply(self, u: FirmwareUpdate, row: Bmc, run: _Run) -> None:
        if u.apply == "bmc-reset":
            await self.ex.execute(
                row, Capability.FIRMWARE_UPDATE, "reset_bmc", lambda d: d.reset_bmc(), write=True
            )
            return
        # host-reset: the flash has completed (the table allows nothing else here).
        state = await chassis.read_power(self.ex, u.machine_id, actor=self.actor)
        action = PowerAction.CYCLE if state is PowerState.ON else PowerAction.ON
        run.power_off_after = state is not PowerState.ON
        await chassis.power(self.ex, u.machine_id, action, actor=self.actor)

    async def _verify(
        self, u: FirmwareUpdate, phase: Phase, d: Decision, run: _Run, late: float
    ) -> Decision:
        try:
            items = await bmc_firmware.refresh_firmware(self.ex, u.machine_id, self.actor)
            have = next((i.version for i in items if i.id == u.item), None)
        except (BmcCommandFailed, Unprocessable) as e:
            have, run.detail = None, e.detail
        if have is not None and have.strip() == u.version.strip():
            if run.power_off_after:
                await chassis.power(self.ex, u.machine_id, PowerAction.OFF, actor=self.actor)
            return decide(phase, Event.VERSION_OK)
        if late > self.cfg.verify_timeout_s:
            return decide(
                phase, Event.TIMEOUT, detail=f"{u.item} reports {have!r}, want {u.version!r}"
            )
        await asyncio.sleep(self.cfg.poll_s)
        return decide(phase, Event.VERSION_OTHER)

    async def _record(self, u: FirmwareUpdate, d: Decision, run: _Run) -> None:
        """The phase the table chose, in the store, before its action is taken."""
        await self.store.run(_set_phase, u.id, d, self.actor, self.instance, run.task)
        u.phase = d.phase.value
        self.notify()


def _plan(
    comps: list[Component], versions: dict[str, str], only: list[str] | None
) -> list[tuple[str, Component, str]]:
    """(inventory item, its baseline component, its version) of every item off baseline
    that metald can flash (the component has an image), narrowed to ``only`` when given."""
    out = []
    for item, have in sorted(versions.items()):
        comp = component_for(comps, item)
        if comp is None or not comp.updatable() or have.strip() == comp.version.strip():
            continue
        if only is not None and item not in only and comp.id not in only:
            continue
        out.append((item, comp, have))
    return out


def _ended_updates(s: Session, ids: list[str]) -> dict[str, FirmwareUpdate]:
    rows = s.exec(
        select(FirmwareUpdate).where(
            col(FirmwareUpdate.id).in_(ids),
            col(FirmwareUpdate.phase).in_([p.value for p in (Phase.DONE, Phase.FAILED)]),
        )
    ).all()
    return {u.id: u for u in rows}


def _release_reflashed(
    s: Session,
    machine_id: str,
    claim_id: str | None,
    rows: list[FirmwareUpdate],
    error: str | None,
    actor: str,
    instance: str,
) -> None:
    """The end of a release's re-flash, on the claim's stream: what was restored, or the
    machine held in the repair queue with why."""
    restored = {u.item: {"before": u.version_before, "after": u.version}
                for u in rows if u.phase == Phase.DONE.value}  # fmt: skip
    if restored:
        add_event(
            s,
            "release.reflashed",
            actor,
            machine_id=machine_id,
            instance=instance,
            reason="firmware restored to the baseline before the wipe: "
            + ", ".join(f"{k} {v['before']} -> {v['after']}" for k, v in restored.items()),
            data={"claim_id": claim_id, "restored": restored, "updates": [u.id for u in rows]},
        )
    if error is not None:
        release.hold_in_repair(
            s,
            machine_id,
            claim_id,
            [{"kind": "firmware", "subject": "firmware", "code": "reflash-failed",
              "severity": "fatal", "witness": "bmc", "why": f"re-flash failed: {error}"[:200],
              "evidence": f"the re-flash to the baseline at release failed: {error}"}],
            actor,
            instance,
        )  # fmt: skip
    s.commit()


def _next_open(s: Session, machine_id: str) -> FirmwareUpdate | None:
    return s.exec(
        select(FirmwareUpdate)
        .where(
            FirmwareUpdate.machine_id == machine_id,
            col(FirmwareUpdate.phase).in_([p.value for p in OPEN]),
        )
        .order_by(col(FirmwareUpdate.created_at), col(FirmwareUpdate.id))
    ).first()


def _component_of(s: Session, u: FirmwareUpdate) -> Component | None:
    b = records.history(s, u.profile)
    for row in b:
        if row.version == u.baseline_version:
            return next((c for c in records.components_of(row) if c.id == u.component), None)
    return None


def _journal(u: FirmwareUpdate, step: str, **extra: Any) -> None:
    u.journal = [*u.journal, {"step": step, "at": utcnow().isoformat(), **extra}][-MAX_JOURNAL:]
    u.updated_at = utcnow()


def _mark_offering(s: Session, update_id: str, transfer: str) -> None:
    u = s.get(FirmwareUpdate, update_id)
    if u is None:
        raise NotFound(f"no firmware update {update_id}")
    u.phase, u.transfer = Phase.OFFERING.value, transfer
    _journal(u, "offering", transfer=transfer)
    s.add(u)
    s.commit()


def _progress(s: Session, update_id: str, task_uri: str, percent: int | None) -> None:
    u = s.get(FirmwareUpdate, update_id)
    if u is None:
        return
    u.task_uri, u.percent = task_uri[:512], percent
    u.updated_at = utcnow()
    s.add(u)
    s.commit()


def _set_phase(
    s: Session,
    update_id: str,
    d: Decision,
    actor: str,
    instance: str,
    task: UpdateTask | None,
) -> None:
    u = s.get(FirmwareUpdate, update_id)
    if u is None:
        raise NotFound(f"no firmware update {update_id}")
    before = u.phase
    u.phase = d.phase.value
    if task is not None:
        u.task_uri, u.percent = task.uri[:512], task.percent
    if d.reason:
        u.error = d.reason[:1000]
    if d.phase in (Phase.DONE, Phase.FAILED):
        u.finished_at = utcnow()
    _journal(u, d.phase.value)
    s.add(u)
    kind = {Phase.DONE: "firmware.updated", Phase.FAILED: "firmware.update-failed"}.get(
        d.phase, "firmware.update"
    )
    add_event(
        s,
        kind,
        actor,
        machine_id=u.machine_id,
        instance=instance,
        reason=d.reason
        or f"{u.item} {u.version_before} -> {u.version}: {before} -> {d.phase.value}",
        data={
            "update_id": u.id,
            "item": u.item,
            "version": u.version,
            "phase": d.phase.value,
            "percent": u.percent,
            "task": u.task_uri,
        },
    )
    s.commit()


def _fail_rest(s: Session, machine_id: str, failed_id: str, actor: str, instance: str) -> None:
    """One update failed: the machine's other queued ones are not started (a person looks)."""
    rest = s.exec(
        select(FirmwareUpdate).where(
            FirmwareUpdate.machine_id == machine_id,
            FirmwareUpdate.phase == Phase.QUEUED.value,
        )
    ).all()
    for u in rest:
        u.phase, u.finished_at = Phase.FAILED.value, utcnow()
        u.error = f"not started: update {failed_id} of this machine failed first"
        _journal(u, "failed")
        s.add(u)
    s.commit()
