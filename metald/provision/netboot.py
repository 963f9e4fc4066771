"""The network-boot step and the steps around it: move machines into provisioning or wiping,
then make them network-boot through their BMC (one-time PXE boot, then power cycle or on).

Database steps are plain Session functions; the boot itself is async and runs in the
background under the ``Provisioner`` service's runner, so an API request never waits on a slow
BMC. What the boot does next is decided by the pure ``netboot_core``; ``NetBootRun`` here only
carries its commands out against the store and the BMC. A BMC failure moves the machine to the
failed state with ``last_error``; a machine without a BMC is left to boot when someone powers
it (the watchdog times it out otherwise).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from sqlmodel import Session

from metald import machines
from metald.bmc import media as virtual_media
from metald.bmc import ownership
from metald.bmc.base import BootTarget, PowerAction
from metald.bmc.control import NotOwner, PowerControl, step_key
from metald.errors import Conflict, MetaldError, NotFound
from metald.lifecycle import NETWORK_BOOT as NETWORK_BOOT_STATES
from metald.lifecycle import OPERATION_FAIL as _FAIL
from metald.lifecycle import RETRY, IllegalTransition, State, Trigger
from metald.provision import boots, media_boot
from metald.provision import netboot_core as core
from metald.provision.intents import DeployImage, inspect_intent, wipe_intent
from metald.store.db import Store, store_unavailable
from metald.store.models import Machine

log = logging.getLogger(__name__)


class StepRunner:
    """Background provisioning steps, owned: whoever holds the runner stops its tasks. The
    daemon's ``Provisioner`` service holds one and cancels its tasks at stop."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background, keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self) -> None:
        """Wait for every background step (tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def cancel_all(self) -> None:
        """Stop every background step (shutdown). A machine left mid-reboot stays in its state;
        the BMC's journal says how far the step got, and its owner resumes it."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Provisioner:
    """The ``provision`` service: owns the background steps started by API calls (its
    ``steps``, given by whoever builds it), and stops them at ``stop``. It is the claim
    workflows' ``BootControl``: database steps run in the caller's transaction, BMC steps in
    the background under its runner."""

    name = "provision"

    def __init__(self, steps: StepRunner | None = None) -> None:
        self.steps = steps if steps is not None else StepRunner()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        await self.steps.cancel_all()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background under this service's runner."""
        return self.steps.spawn(coro)

    def start_provisioning(
        self, session: Session, machine_ids: list[str], *, actor: str, instance: str | None = None
    ) -> list[str]:
        return start_provisioning(session, machine_ids, actor=actor, instance=instance)

    def retry(
        self,
        session: Session,
        machine_id: str,
        *,
        actor: str,
        deploy: DeployImage,
        reason: str | None = None,
        version: int | None = None,
        instance: str | None = None,
    ) -> Machine:
        return retry(
            session,
            machine_id,
            actor=actor,
            deploy=deploy,
            reason=reason,
            version=version,
            instance=instance,
        )

    async def reboot_all(
        self,
        store: Store,
        bmc: Any,
        machine_ids: list[str],
        *,
        actor: str,
        instance: str | None = None,
    ) -> None:
        await reboot_all(store, bmc, machine_ids, actor=actor, instance=instance)


def start_provisioning(
    session: Session, machine_ids: list[str], *, actor: str, instance: str | None = None
) -> list[str]:
    """PROVISION each claimed machine (its boot intent was set with the claim). Returns those
    moved; one already moved by someone else is skipped."""
    moved = []
    for mid in machine_ids:
        try:
            machines.transition(
                session,
                mid,
                Trigger.PROVISION,
                actor=actor,
                reason="installing the claim's image",
                updates={"last_error": None},
                instance=instance,
            )
            moved.append(mid)
        except (IllegalTransition, machines.ConcurrentUpdate):
            session.rollback()
    return moved


def retry(
    session: Session,
    machine_id: str,
    *,
    actor: str,
    deploy: DeployImage,
    reason: str | None = None,
    version: int | None = None,
    instance: str | None = None,
) -> Machine:
    """Start a failed operation again (provision-failed -> provisioning, ...)."""
    m = machines.get_machine(session, machine_id)
    trigger = RETRY.get(State(m.state))
    if trigger is None:
        failed = ", ".join(s.value for s in RETRY)
        raise Conflict(
            f"machine {m.id} is {m.state}; retry applies only to a failed state ({failed})",
            state=m.state,
        )
    updates: dict[str, Any] = {"last_error": None}
    if trigger is Trigger.INSPECT:
        updates["boot_intent"] = inspect_intent()
    elif trigger is Trigger.WIPE:
        updates["boot_intent"] = wipe_intent(deploy)
    return machines.transition(
        session,
        m.id,
        trigger,
        actor=actor,
        reason=reason or f"retry after {m.state}",
        expected_version=version,
        updates=updates,
        data={"retry": True, "previous_error": m.last_error},
        instance=instance,
    )


def _fail(session: Session, machine_id: str, error: str, actor: str, instance: str | None) -> None:
    """The step gave up: the machine's operation fails with ``error``; where it moved on
    meanwhile (the agent reported, or someone released it), the give-up is still an event."""
    m = machines.get_machine(session, machine_id)
    trigger = _FAIL.get(State(m.state))
    if trigger is not None:
        try:
            machines.transition(
                session,
                machine_id,
                trigger,
                actor=actor,
                reason=error,
                expected_version=m.version,
                updates={"last_error": error},
                instance=instance,
            )
            return
        except (IllegalTransition, machines.ConcurrentUpdate):
            session.rollback()
    _note(session, machine_id, FAILED_EVENT, error, actor, instance)


#: A network boot through the BMC gave up while its machine was no longer in the state it was
#: started for (the failure is otherwise the operation's failed state and its last_error).
FAILED_EVENT = "provision.network-boot-failed"


#: Event kinds that show a machine's network boot was asked for (or cannot be) since it entered
#: its state; see ``watchdog.interrupted_boots``.
NETWORK_BOOT_EVENT = "provision.network-boot"
BOOT_HANDLED_EVENTS = (NETWORK_BOOT_EVENT, "provision.no-bmc", "provision.progress")


def _note(
    session: Session, machine_id: str, kind: str, reason: str, actor: str, instance: str | None
) -> None:
    machines.add_event(
        session, kind, actor, machine_id=machine_id, reason=reason, instance=instance
    )
    session.commit()


def _arm(
    session: Session,
    machine_id: str,
    reason: str,
    actor: str,
    instance: str | None,
    iso: str | None = None,
    media: bool = False,
) -> str | None:
    """Arm the boot metald is about to start, with its note, if the machine is still in a
    state that boots over the network: its nonce; None if it moved on meanwhile (nothing
    armed). ``media``: a virtual-media boot fetching its ISO from ``iso`` (the boot base)."""
    m = machines.get_machine(session, machine_id)
    if State(m.state) not in NETWORK_BOOT_STATES:
        return None
    armed = boots.arm_boot(session, machine_id, media=media)
    machines.add_event(
        session,
        NETWORK_BOOT_EVENT,
        actor,
        machine_id=machine_id,
        reason=reason,
        # via/image: metald.bmc.media ejects a virtual-media boot's ISO once its agent reports
        # (the ISO's URL carries the nonce: only its redacted form is recorded)
        data={
            "state": m.state,
            "via": "virtual-media" if media else "network",
            "image": media_boot.redact(media_boot.iso_url(iso, machine_id, armed))
            if media and iso
            else None,
        },
        instance=instance,
    )
    session.commit()
    return armed


def _media_armed(session: Session, machine_id: str) -> bool:
    return media_boot.is_media_boot(machines.get_machine(session, machine_id).boot_armed)


def control_of(bmc: Any) -> PowerControl:
    """The typed control behind what callers pass as ``bmc``: the daemon's BmcService (its
    ``control``) or a PowerControl itself."""
    return getattr(bmc, "control", bmc)


def _load_step(session: Session, machine_id: str) -> tuple[str | None, core.StepLoaded]:
    """The machine's current step (None when its state does not boot over the network) and
    what its BMC's journal holds of that step."""
    m = machines.get_machine(session, machine_id)
    if State(m.state) not in NETWORK_BOOT_STATES:
        return None, core.StepLoaded(booting=False)
    step = step_key(m)
    journal = ownership.read_step(session, machine_id, step)
    if journal is None:
        return step, core.StepLoaded(booting=True)
    if journal.command is None and not journal.done:
        # A new step is journaled ``requested`` before its first command, in this transaction:
        # an instance killed before that command leaves it for the BMC's next holder, who
        # resumes it at takeover (the watchdog's unfinished steps), not after the cut-off-boot
        # sweep's claimed_resume_s. Never over a step already under way (``mark_step``).
        ownership.mark_step(session, machine_id, step, command=core.REQUESTED, done=False)
    return step, core.StepLoaded(booting=True, command=journal.command, done=journal.done)


async def boot_from_network(
    store: Store,
    bmc: Any,
    machine_id: str,
    *,
    actor: str,
    instance: str | None = None,
    via: str | None = None,
) -> bool:
    """Take the machine (hard power-off, confirmed), set a one-time PXE boot, arm the boot
    (``metald.provision.boots``: the first script of this boot carries the agent token), then
    power it on. False if it failed or is left to the BMC's owner. Without a BMC the machine is
    left alone: nothing is armed, so a wipe then needs a technician (``confirm-wipe``).

    Resumable: each command is journaled on the BMC's row before it is sent, so a step cut
    off (this or another instance killed) continues from there, and a command whose effect
    can be read (power) is read, never sent again blindly (``netboot_core`` decides each
    command). One run per machine at a time in this instance.

    ``via`` "virtual-media" (or None and the machine labelled ``boot-via=virtual-media``):
    instead of a PXE boot, insert metald's boot ISO into the BMC's virtual CD (Redfish) and
    boot it once; the rest (confirmed power-off, arming, power-on) is the same."""
    control = control_of(bmc)
    busy: set[str] | None = getattr(control, "in_flight", None)
    if busy is not None:
        if machine_id in busy:
            return False
        busy.add(machine_id)
    try:
        run = NetBootRun(store, control, machine_id, actor, instance, via)
        return (await run.run()).ok
    finally:
        if busy is not None:
            busy.discard(machine_id)


def _iso_for(session: Session, bmc: Any, machine_id: str, via: str | None) -> str | None:
    """The boot HTTP base the BMC fetches the boot's ISO from, or None for a PXE boot."""
    if via is None:
        labels = machines.get_machine(session, machine_id).labels
        via = "virtual-media" if virtual_media.wants_virtual_media(labels) else "network"
    if via != "virtual-media":
        return None
    url = virtual_media.boot_base(bmc)
    if url is None:
        raise MetaldError(
            "virtual media boot needs metald's boot HTTP to serve the ISO (boot.enabled with "
            "boot.http_url or boot.server_address); configure it, or remove the machine's "
            "boot-via=virtual-media label to boot it over the network"
        )
    return url


class NetBootRun:
    """One run of the step: carries out what ``netboot_core`` decides, one command at a time,
    and tells it what happened. Everything here is I/O; every decision is the core's."""

    def __init__(
        self,
        store: Store,
        bmc: PowerControl,
        machine_id: str,
        actor: str,
        instance: str | None,
        via: str | None = None,
    ) -> None:
        self.store = store
        self.bmc = bmc
        self.machine_id = machine_id
        self.actor = actor
        self.instance = instance
        self.via = via
        self.step: str | None = None  # the step's journal key, once loaded
        self.iso: str | None = None  # the boot HTTP base of a virtual-media boot

    async def run(self) -> core.Outcome:
        state, todo = core.start()
        while not isinstance(todo, core.Outcome):
            event = await self._event(todo)
            state, todo = core.advance(state, event)
        self._log(todo)
        return todo

    async def _event(self, command: core.Command) -> core.Event:
        """Carry out ``command``; what happened, failures included, as the core's event."""
        try:
            return await self._do(command)
        except NotOwner as e:
            return core.NotOwner(e.detail)
        except NotFound as e:
            return core.NoBmc(e.detail)
        except Exception as e:  # noqa: BLE001 - any failure ends the step visibly, never silently
            if store_unavailable(e):  # not the BMC's failure: the watchdog resumes the boot
                return core.StoreDown()
            detail = e.detail if isinstance(e, MetaldError) else f"{type(e).__name__}: {e}"
            return core.BmcFailed(detail)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    async def _do(self, c: core.Command) -> core.Event:  # noqa: C901 - one arm per command
        mid, actor, step, run = self.machine_id, self.actor, self.step, self.store.run
        match c:
            case core.LoadStep():
                self.step, stored = await run(_load_step, mid)
                return stored
            case core.LoadVia():
                self.iso = await run(_iso_for, self.bmc, mid, self.via)
                return core.ViaLoaded(media=self.iso is not None)
            case core.CheckMediaArmed():
                return core.MediaArmed(await run(_media_armed, mid))
            case core.ReadPower(delay_s=delay):
                if delay > 0:
                    await asyncio.sleep(delay)
                state = await self.bmc.read_power(mid, actor=actor)
                return core.PowerRead(str(state), self._now())
            case core.PowerOff():
                await self.bmc.power(mid, PowerAction.OFF, actor=actor, step=step)
            case core.PowerOn():
                await self.bmc.power(mid, PowerAction.ON, actor=actor, step=step)
            case core.SetBootPxe():
                # uefi=None: keep the machine's own firmware mode (a BIOS machine refuses a
                # UEFI override and a UEFI one may not PXE in legacy mode).
                await self.bmc.set_boot_device(
                    mid, BootTarget.PXE, False, uefi=None, actor=actor, step=step
                )
            case core.Arm(media=True):
                # The machine is off, and the per-MAC script never hands out a media boot's
                # token: the ISO's URL (with the nonce) is the only way to it (media_boot).
                reason = (
                    "power off, insert the boot ISO, one-time CD boot and power on through the BMC"
                )
                return core.Armed(
                    await run(_arm, mid, reason, actor, self.instance, self.iso, True)
                )
            case core.Arm():
                # The watchdog reads the note to tell a boot that was asked for from one a
                # restart cut off.
                reason = "power off, one-time PXE boot and power on through the BMC"
                return core.Armed(await run(_arm, mid, reason, actor, self.instance))
            case core.InsertMedia(nonce=nonce):
                url = media_boot.iso_url(self.iso, mid, nonce)  # type: ignore[arg-type]
                await virtual_media.insert_for(self.bmc, mid, url, step)
            case core.BootCd():
                await virtual_media.boot_cd_for(self.bmc, mid, step)
            case core.MarkDone() if step is not None:
                await run(ownership.mark_step, mid, step, command=None, done=True)
            case core.HandOver() if step is not None:
                # Another instance owns the BMC: the step is left in the store for it (its
                # watchdog runs unfinished steps of the BMCs it holds).
                await run(ownership.mark_step, mid, step, command=core.REQUESTED, done=False)
            case core.NoteNoBmc(detail=detail):
                await run(_note, mid, "provision.no-bmc", detail, actor, self.instance)
            case core.Fail(error=error):
                log.warning("machine %s: network boot through the BMC failed: %s", mid, error)
                await run(_fail, mid, error, actor, self.instance)
        return core.Sent(self._now())

    def _log(self, outcome: core.Outcome) -> None:
        mid = self.machine_id
        if outcome is core.Outcome.LEFT_TO_OWNER:
            log.info("machine %s: network boot left to the BMC's owner", mid)
        elif outcome is core.Outcome.POSTPONED:
            log.warning("machine %s: network boot postponed: database unavailable", mid)


async def reboot_all(
    store: Store, bmc: Any, machine_ids: list[str], *, actor: str, instance: str | None = None
) -> None:
    if bmc is None or not machine_ids:
        return

    async def one(mid: str) -> None:
        try:
            await boot_from_network(store, bmc, mid, actor=actor, instance=instance)
        except Exception as e:
            if not store_unavailable(e):
                raise
            # Cut off from the database (restarting): the watchdog resumes the boot
            # (interrupted_boots); an unretrieved task exception would be all that is left.
            log.warning("machine %s: network boot postponed: database unavailable", mid)

    await asyncio.gather(*(one(mid) for mid in machine_ids))
