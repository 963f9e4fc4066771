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
from collections.abc import Coroutine
from typing import Any

from sqlmodel import Session

from metald import machines
from metald.errors import Conflict, MetaldError, NotFound
from metald.lifecycle import NETWORK_BOOT as NETWORK_BOOT_STATES
from metald.lifecycle import OPERATION_FAIL as _FAIL
from metald.lifecycle import RETRY, IllegalTransition, State, Trigger
from metald.provision import boots
from metald.provision.intents import DeployImage, inspect_intent, wipe_intent
from metald.store.db import Store
from metald.store.models import Machine

log = logging.getLogger(__name__)

_tasks: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    """Run ``coro`` in the background, keeping a reference until it ends."""
    task = asyncio.get_running_loop().create_task(coro)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    return task


async def drain() -> None:
    """Wait for every background step (tests)."""
    while _tasks:
        await asyncio.gather(*list(_tasks), return_exceptions=True)


async def cancel_all() -> None:
    """Stop every background step (shutdown). A machine left mid-reboot stays in its state;
    the watchdog times it out and the retry action starts it again."""
    tasks = list(_tasks)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


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


def _arm(session: Session, machine_id: str, reason: str, actor: str, instance: str | None) -> bool:
    """Arm the boot metald is about to start, with its note, if the machine is still in a
    state that boots over the network; False if it moved on meanwhile (nothing armed)."""
    m = machines.get_machine(session, machine_id)
    if State(m.state) not in NETWORK_BOOT_STATES:
        return False
    boots.arm_boot(session, machine_id)
    machines.add_event(
        session,
        NETWORK_BOOT_EVENT,
        actor,
        machine_id=machine_id,
        reason=reason,
        data={"state": m.state},
        instance=instance,
    )
    session.commit()
    return True


#: How long the driver waits for a machine to report off after a hard power-off.
POWER_OFF_WAIT_S = 60.0
POWER_OFF_POLL_S = 1.0


async def _power_off(bmc: Any, machine_id: str, actor: str) -> None:
    """Hard power-off through the BMC, and wait until the BMC reports the machine off: from
    then on nothing the machine ran before (a tenant's OS) can ask metald for anything."""
    status = await bmc.power(machine_id, "status", actor=actor)
    if status.get("power_state") == "off":
        return
    await bmc.power(machine_id, "off", actor=actor)
    deadline = asyncio.get_running_loop().time() + POWER_OFF_WAIT_S
    while (await bmc.power(machine_id, "status", actor=actor)).get("power_state") != "off":
        if asyncio.get_running_loop().time() > deadline:
            raise MetaldError(
                f"the BMC did not report the machine off within {POWER_OFF_WAIT_S:.0f} s of a "
                "power-off; check the BMC and retry"
            )
        await asyncio.sleep(POWER_OFF_POLL_S)


async def boot_from_network(
    store: Store, bmc: Any, machine_id: str, *, actor: str, instance: str | None = None
) -> bool:
    """Take the machine (hard power-off, confirmed), set a one-time PXE boot, arm the boot
    (``metald.provision.boots``: the first script of this boot carries the agent token), then
    power it on. False if it failed. Without a BMC the machine is left alone: nothing is armed,
    so a wipe then needs a technician (``confirm-wipe``)."""
    try:
        await _power_off(bmc, machine_id, actor)
        # uefi=None: keep the machine's own firmware mode (a BIOS machine refuses a UEFI
        # override and a UEFI one may not PXE in legacy mode).
        await bmc.set_boot_device(machine_id, "pxe", persistent=False, uefi=None, actor=actor)
        # The watchdog reads the note to tell a boot that was asked for from one a restart
        # cut off.
        reason = "power off, one-time PXE boot and power on through the BMC"
        if not await store.run(_arm, machine_id, reason, actor, instance):
            return False
        await bmc.power(machine_id, "on", actor=actor)
        return True
    except NotFound as e:
        await store.run(_note, machine_id, "provision.no-bmc", e.detail, actor, instance)
        return False
    except Exception as e:  # any BMC failure ends the operation visibly, never silently
        detail = e.detail if isinstance(e, MetaldError) else f"{type(e).__name__}: {e}"
        log.warning("machine %s: network boot through the BMC failed: %s", machine_id, detail)
        await store.run(_fail, machine_id, f"BMC: {detail}", actor, instance)
        return False


async def reboot_all(
    store: Store, bmc: Any, machine_ids: list[str], *, actor: str, instance: str | None = None
) -> None:
    if bmc is None or not machine_ids:
        return
    await asyncio.gather(
        *(boot_from_network(store, bmc, mid, actor=actor, instance=instance) for mid in machine_ids)
    )
