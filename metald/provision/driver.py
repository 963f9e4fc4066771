"""The step after a claim or release: move machines into provisioning or wiping, then make them
network-boot through their BMC (one-time PXE boot, then power cycle or on).

Database steps are plain Session functions; BMC steps are async and run in the background
(``spawn``), so an API request never waits on a slow BMC. A BMC failure moves the machine to
the failed state with ``last_error``; a machine without a BMC is left to boot when someone
powers it (the watchdog times it out otherwise).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Coroutine
from typing import Any

from sqlmodel import Session

from metald import machines
from metald.bmc import media as virtual_media
from metald.bmc import ownership
from metald.bmc.base import BootTarget, PowerAction, PowerState
from metald.bmc.control import NotOwner, PowerControl, step_key
from metald.bmc.ownership import StepJournal
from metald.errors import Conflict, MetaldError, NotFound
from metald.lifecycle import NETWORK_BOOT as NETWORK_BOOT_STATES
from metald.lifecycle import OPERATION_FAIL as _FAIL
from metald.lifecycle import RETRY, IllegalTransition, State, Trigger
from metald.provision import boots, media_boot
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
    """The ``provision`` service: owns the background steps started by API calls."""

    name = "provision"

    def __init__(self) -> None:
        self.steps = StepRunner()

    async def start(self) -> None:
        _RUNNERS[asyncio.get_running_loop()] = self.steps

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        if _RUNNERS.get(loop) is self.steps:
            del _RUNNERS[loop]
        await self.steps.cancel_all()


#: The runner ``spawn`` hands API-started steps to, per event loop: the daemon's Provisioner
#: while it runs (it stops them), else one made on first use (an API under test).
_RUNNERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, StepRunner] = (
    weakref.WeakKeyDictionary()
)


def runner() -> StepRunner:
    loop = asyncio.get_running_loop()
    r = _RUNNERS.get(loop)
    if r is None:
        r = _RUNNERS[loop] = StepRunner()
    return r


def spawn(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    """Run ``coro`` in the background under this loop's step runner (see ``Provisioner``)."""
    return runner().spawn(coro)


async def drain() -> None:
    """Wait for every background step of this loop's runner (tests)."""
    await runner().drain()


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
    m = machines.get_machine(session, machine_id)
    trigger = _FAIL.get(State(m.state))
    if trigger is None:
        return  # it moved on meanwhile (the agent reported, or someone released it)
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
    except (IllegalTransition, machines.ConcurrentUpdate):
        session.rollback()


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


#: How long the driver waits for a machine to report off after a hard power-off.
POWER_OFF_WAIT_S = 60.0
POWER_OFF_POLL_S = 1.0


def control_of(bmc: Any) -> PowerControl:
    """The typed control behind what callers pass as ``bmc``: the daemon's BmcService (its
    ``control``) or a PowerControl itself."""
    return getattr(bmc, "control", bmc)


async def _wait_off(bmc: PowerControl, machine_id: str, actor: str) -> None:
    deadline = asyncio.get_running_loop().time() + POWER_OFF_WAIT_S
    while await bmc.read_power(machine_id, actor=actor) is not PowerState.OFF:
        if asyncio.get_running_loop().time() > deadline:
            raise MetaldError(
                f"the BMC did not report the machine off within {POWER_OFF_WAIT_S:.0f} s of a "
                "power-off; check the BMC and retry"
            )
        await asyncio.sleep(POWER_OFF_POLL_S)


async def _power_off(bmc: PowerControl, machine_id: str, actor: str, step: str | None) -> None:
    """Hard power-off through the BMC, and wait until the BMC reports the machine off: from
    then on nothing the machine ran before (a tenant's OS) can ask metald for anything."""
    if await bmc.read_power(machine_id, actor=actor) is PowerState.OFF:
        return
    await bmc.power(machine_id, PowerAction.OFF, actor=actor, step=step)
    await _wait_off(bmc, machine_id, actor)


def _step_of(session: Session, machine_id: str) -> tuple[str | None, StepJournal | None]:
    """The machine's current step (None when its state does not boot over the network) and
    its BMC's journal of that step."""
    m = machines.get_machine(session, machine_id)
    if State(m.state) not in NETWORK_BOOT_STATES:
        return None, None
    step = step_key(m)
    return step, ownership.read_step(session, machine_id, step)


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
    can be read (power) is read, never sent again blindly. One run per machine at a time in
    this instance.

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
        return await _boot(store, control, machine_id, actor, instance, via)
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
            "virtual media boot needs metald's boot HTTP (boot.http_url or boot.http_listen) "
            "to serve the ISO; configure it, or boot the machine over the network"
        )
    return url


async def _boot(
    store: Store,
    bmc: PowerControl,
    machine_id: str,
    actor: str,
    instance: str | None,
    via: str | None = None,
) -> bool:
    step: str | None = None
    try:
        step, journal = await store.run(_step_of, machine_id)
        if step is None:
            return False
        if journal is not None and journal.done:
            return True
        sent = journal.command if journal is not None else None
        iso = await store.run(_iso_for, bmc, machine_id, via)
        if sent in (None, "requested"):
            await _power_off(bmc, machine_id, actor, step)
            sent = "power:off"
        elif sent == "power:off":  # sent before a failover: wait for it, never send it again
            await _wait_off(bmc, machine_id, actor)
        if iso is not None and sent == "boot:cd" and not await store.run(_media_armed, machine_id):
            sent = "power:off"  # the inserted ISO's boot is gone (taken or re-armed): again
        if iso is not None and sent in ("power:off", "vmedia:insert"):
            # Armed first, with a nonce of its own: the ISO (built per boot) carries its URL,
            # the only way to this boot's token (media_boot). The machine is off, and the
            # per-MAC script never hands out a media boot's token. Inserting again after a
            # failover is harmless (insert ejects what is there first; a new nonce).
            reason = "power off, insert the boot ISO, one-time CD boot and power on through the BMC"
            armed = await store.run(_arm, machine_id, reason, actor, instance, iso, True)
            if not armed:
                return False
            url = media_boot.iso_url(iso, machine_id, armed)
            await virtual_media.insert_for(bmc, machine_id, url, step)  # type: ignore[arg-type]
            await virtual_media.boot_cd_for(bmc, machine_id, step)  # type: ignore[arg-type]
            await bmc.power(machine_id, PowerAction.ON, actor=actor, step=step)
        elif sent == "boot:cd":
            await bmc.power(machine_id, PowerAction.ON, actor=actor, step=step)
        elif sent == "power:off":
            # uefi=None: keep the machine's own firmware mode (a BIOS machine refuses a UEFI
            # override and a UEFI one may not PXE in legacy mode).
            await bmc.set_boot_device(
                machine_id, BootTarget.PXE, False, uefi=None, actor=actor, step=step
            )
            sent = "boot:pxe"
        if sent == "boot:pxe":
            # The watchdog reads the note to tell a boot that was asked for from one a
            # restart cut off.
            reason = "power off, one-time PXE boot and power on through the BMC"
            if not await store.run(_arm, machine_id, reason, actor, instance):
                return False
            await bmc.power(machine_id, PowerAction.ON, actor=actor, step=step)
        elif (
            sent == "power:on"
            and await bmc.read_power(machine_id, actor=actor) is not PowerState.ON
        ):
            # Sent before a failover, and the machine reads off: the command never reached
            # the BMC (powering on what is off cannot act twice). On: it is booting.
            await bmc.power(machine_id, PowerAction.ON, actor=actor, step=step)
        await store.run(ownership.mark_step, machine_id, step, command=None, done=True)
        return True
    except NotOwner as e:
        # Another instance owns the BMC: the step is left in the store for it (its watchdog
        # runs unfinished steps of the BMCs it holds).
        log.info("machine %s: network boot left to the BMC's owner (%s)", machine_id, e.detail)
        if step is not None:
            try:
                await store.run(
                    ownership.mark_step, machine_id, step, command="requested", done=False
                )
            except Exception:  # noqa: BLE001 - fenced: the store is unreachable
                log.warning("machine %s: could not hand the step over", machine_id, exc_info=True)
        return False
    except NotFound as e:
        await store.run(_note, machine_id, "provision.no-bmc", e.detail, actor, instance)
        return False
    except Exception as e:  # any BMC failure ends the operation visibly, never silently
        if store_unavailable(e):  # not the BMC's failure: the watchdog resumes the boot
            log.warning("machine %s: network boot postponed: database unavailable", machine_id)
            return False
        detail = e.detail if isinstance(e, MetaldError) else f"{type(e).__name__}: {e}"
        log.warning("machine %s: network boot through the BMC failed: %s", machine_id, detail)
        await store.run(_fail, machine_id, f"BMC: {detail}", actor, instance)
        if step is not None:
            await store.run(ownership.mark_step, machine_id, step, command=None, done=True)
        return False


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
