"""Chassis commands of a machine's BMC: power (with its confirmation), the boot device and the
locate light; each through the fenced executor (``metald.bmc.control.Executor``) and the
capability it needs (``Power``, ``BootDeviceControl``, ``Indicator``), each recorded as an event.
Also the store's side of power readings (``record_power``, and ``record_powers`` for power
sync's rounds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from sqlalchemy import update
from sqlmodel import Session, col, select

from metald.bmc.base import BmcError, BootDevice, BootTarget, PowerAction, PowerState, cause
from metald.bmc.capabilities import Capability, CapabilityMissing
from metald.bmc.control import BmcCommandFailed, Executor, Expected
from metald.bmc.power_confirm import CommandStatus, PowerCommand, target_of, wait_for_state
from metald.errors import Unprocessable
from metald.machines import add_event
from metald.store.models import Bmc, Machine

log = logging.getLogger(__name__)


async def power(
    ex: Executor,
    machine_id: str,
    action: PowerAction,
    *,
    actor: str = "system",
    step: str | None = None,
) -> PowerState:
    """Provisioning's power action: the state the BMC reported (the target once confirmed); a
    command still pending after power_state_timeout_s reports its last reading."""
    row = await ex.row_for_machine(machine_id)
    cmd = await power_row(ex, row, action, actor, step)
    return cmd.observed if cmd.observed is not None else await read_power_row(ex, row)


async def read_power(ex: Executor, machine_id: str, *, actor: str = "system") -> PowerState:
    return await read_power_row(ex, await ex.row_for_machine(machine_id))


async def read_power_row(ex: Executor, row: Bmc) -> PowerState:
    """Ask the BMC now, and record what it said (not drift: someone asked)."""
    state: PowerState = await ex.execute(
        row, Capability.POWER, "get_power", lambda d: d.get_power()
    )
    await ex.store.run(record_power, row.id, state, None, ex.instance)
    return state


async def power_row(
    ex: Executor,
    row: Bmc,
    action: PowerAction,
    actor: str,
    step: str | None = None,
    *,
    wait_s: float | None = None,
) -> PowerCommand:
    """Send a power action, then wait up to ``wait_s`` (default ``power_state_timeout_s``)
    for the BMC to report the state it ends in. The command comes back confirmed, failed,
    or still pending (``answered``): its confirmation then goes on in the background until
    ``power_state_give_up_s`` and reports its outcome as an event. The recorded power
    state is only ever what the BMC reported."""
    act = PowerAction(action)
    cmd = PowerCommand(row.id, row.machine_id, act, target_of(act))
    cfg = ex.cfg

    def expect() -> None:
        # Expected before it is sent, so a sync reading in between is not reported as drift.
        ex.expected[row.id] = Expected(cmd.target, time.monotonic() + cfg.drift_grace_s)

    await ex.execute(
        row,
        Capability.POWER,
        f"power_{act.value}",
        lambda d: d.set_power(act),
        journal=f"power:{act.value}",
        step=step,
        write=True,
        before_send=expect,
        idempotent=act not in (PowerAction.CYCLE, PowerAction.RESET),
    )
    ex.commands.add(cmd)
    task = ex.spawn(_confirm(ex, row, cmd, actor), name=f"bmc-confirm-{cmd.id}")
    wait = cfg.power_state_timeout_s
    if wait_s is not None:
        wait = min(wait, max(0.0, wait_s))
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), wait)
    # Nothing runs between the timeout and this line: the task sees ``answered`` when done.
    cmd.answered = not task.done()

    def record(s: Session) -> None:
        add_event(
            s,
            "bmc.power",
            actor,
            machine_id=row.machine_id,
            instance=ex.instance,
            data={
                "bmc_id": row.id,
                "action": act.value,
                "command_id": cmd.id,
                "status": cmd.status.value,
                "power_state": cmd.observed.value if cmd.observed else None,
                "elapsed_s": cmd.elapsed_s,
            },
        )
        s.commit()

    await ex.store.run(record)
    if cmd.status is CommandStatus.FAILED:
        raise BmcCommandFailed(
            f"power {act.value} on BMC {row.id}: the BMC accepted it but did not report "
            f"power {cmd.target.value} within {cfg.power_state_give_up_s:g} s "
            f"(last reading: {cmd.observed.value if cmd.observed else 'none'}); check the "
            "machine's power supply and the BMC",
            bmc_id=row.id,
            command_id=cmd.id,
        )
    return cmd


async def _confirm(ex: Executor, row: Bmc, cmd: PowerCommand, actor: str) -> None:
    """Read the BMC (backing off) until it reports the command's target state or
    ``power_state_give_up_s`` passed; record each reading; when the request already
    answered 202, report the outcome as an event."""

    async def reading(state: PowerState) -> None:
        cmd.last_error = None
        if state is not cmd.observed:
            cmd.observed = state
            await ex.store.run(record_power, row.id, state, None, ex.instance)

    def failed_read(e: Exception) -> None:
        cmd.last_error = cause(e)

    give_up_s = ex.cfg.power_state_give_up_s
    cmd.status = await wait_for_state(
        lambda: ex.run(row, "confirm_power", lambda d: d.get_power()),
        cmd.target,
        cmd.sent_at + give_up_s,
        reading,
        failed_read,
        (BmcError,),
    )
    cmd.done_at = time.monotonic()
    if not cmd.answered and cmd.status is CommandStatus.CONFIRMED:
        return
    failed = cmd.status is CommandStatus.FAILED
    if failed:
        log.warning("BMC %s never reported power %s", row.id, cmd.target.value)

    def record(s: Session) -> None:
        add_event(
            s,
            "bmc.power-failed" if failed else "bmc.power-confirmed",
            actor,
            machine_id=row.machine_id,
            instance=ex.instance,
            reason=(
                f"the BMC did not report power {cmd.target.value} within "
                f"{give_up_s:g} s of power {cmd.action.value}"
                if failed
                else None
            ),
            data=cmd.public(),
        )
        s.commit()

    await ex.store.run(record)


async def set_boot_device(
    ex: Executor,
    machine_id: str,
    device: BootTarget,
    persistent: bool = False,
    *,
    uefi: bool | None = None,
    actor: str = "system",
    step: str | None = None,
) -> None:
    row = await ex.row_for_machine(machine_id)
    boot = BootDevice(BootTarget(device), bool(persistent), uefi)
    await ex.execute(
        row,
        Capability.BOOT_DEVICE,
        "set_boot_device",
        lambda d: d.set_boot_device(boot),
        journal=f"boot:{boot.device.value}",
        step=step,
        write=True,
    )

    def record(s: Session) -> None:
        add_event(
            s,
            "bmc.boot-device",
            actor,
            machine_id=machine_id,
            instance=ex.instance,
            data={
                "bmc_id": row.id,
                "device": boot.device.value,
                "persistent": boot.persistent,
                "uefi": boot.uefi,
            },
        )
        s.commit()

    await ex.store.run(record)


async def set_locate(ex: Executor, row: Bmc, on: bool, *, actor: str = "system") -> bool | None:
    """Light (or turn off) the machine's locate indicator; returns what the BMC reports
    afterwards (None where it does not say)."""
    await ex.execute(
        row, Capability.INDICATOR, "set_locate", lambda d: d.set_locate(on), write=True
    )
    state = await read_locate(ex, row)

    def record(s: Session) -> None:
        add_event(
            s,
            "bmc.locate",
            actor,
            machine_id=row.machine_id,
            instance=ex.instance,
            data={"bmc_id": row.id, "on": on, "reported": state},
        )
        s.commit()

    await ex.store.run(record)
    return state


async def read_locate(ex: Executor, row: Bmc) -> bool | None:
    try:
        return await ex.execute(row, Capability.INDICATOR, "get_locate", lambda d: d.get_locate())
    except CapabilityMissing:
        raise
    except Unprocessable:  # the BMC lights it but cannot say whether it is lit
        return None


def set_power(s: Session, bmc_id: str, machine_id: str | None, state: str) -> None:
    # power_state is an observation, not a lifecycle change: no version bump, so it never makes a
    # concurrent lifecycle writer fail its compare-and-swap.
    s.execute(update(Bmc).where(Bmc.id == bmc_id).values(power_state=str(state)))  # type: ignore[arg-type]
    if machine_id:
        s.execute(
            update(Machine)
            .where(Machine.id == machine_id)  # type: ignore[arg-type]
            .values(power_state=str(state))
        )


def record_power(
    s: Session, bmc_id: str, observed: PowerState, drift_actor: str | None, instance: str
) -> bool:
    """Store an observed power state; with ``drift_actor``, a change nobody asked for becomes a
    ``bmc.power-drift`` event. Returns whether it drifted."""
    return record_powers(s, [(bmc_id, observed, drift_actor)], instance) == 1


def record_powers(
    s: Session, readings: Sequence[tuple[str, PowerState, str | None]], instance: str
) -> int:
    """Store many observed power states in one transaction (power sync's round): each is
    ``record_power``'s ``(bmc_id, observed, drift_actor)``. One read of the BMCs' current
    states, and a write (and commit) only for those that changed: a round over thousands of
    BMCs whose power did not move costs a read, not a transaction a BMC. Returns how many
    drifted."""
    if not readings:
        return 0
    ids = [r[0] for r in readings]
    current = {
        row[0]: (row[1], row[2])
        for row in s.execute(
            select(Bmc.id, Bmc.power_state, Bmc.machine_id).where(col(Bmc.id).in_(ids))
        )
    }
    drifted = changed = 0
    for bmc_id, observed, drift_actor in readings:
        if bmc_id not in current:
            continue
        before, machine_id = current[bmc_id]
        if before == observed.value:
            continue
        if drift_actor is not None and before is not None:
            drifted += 1
            add_event(
                s,
                "bmc.power-drift",
                drift_actor,
                machine_id=machine_id,
                from_state=before,
                to_state=observed.value,
                instance=instance,
                reason="power state changed without a metald command",
                data={"bmc_id": bmc_id},
            )
        set_power(s, bmc_id, machine_id, observed)
        current[bmc_id] = (observed.value, machine_id)
        changed += 1
    if changed:
        s.commit()
    return drifted
