"""BMC commands, implemented: drivers, the scheduler, health, and ownership fencing.

``BmcControl`` implements ``metald.bmc.control.PowerControl`` and owns the per-BMC driver
sessions and their health. With several instances (metald.fleet) a command is sent only by the
BMC's owner, and only after the store confirmed, in the same statement that journals it, that
this instance still holds the BMC at the generation it acquired (``metald.bmc.ownership``): an
instance that lost the BMC (judged dead, superseded) cannot send anything, and a fenced one
does not even ask.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import update
from sqlmodel import Session, select

from metald.bmc import ownership
from metald.bmc.base import (
    BmcDriver,
    BmcEndpoint,
    BmcError,
    BmcUnsupported,
    BootDevice,
    BootTarget,
    LogEntry,
    PowerAction,
    PowerState,
    Sensor,
)
from metald.bmc.control import BmcCommandFailed, BmcOwnership, NoBmc, NotOwner
from metald.bmc.ipmi import IpmiDriver
from metald.bmc.power_confirm import (
    CommandBook,
    CommandStatus,
    PowerCommand,
    target_of,
    wait_for_state,
)
from metald.bmc.redfish import RedfishDriver
from metald.bmc.scheduler import BmcScheduler, Health
from metald.config import BmcConfig
from metald.errors import NotFound, Unprocessable
from metald.machines import add_event, get_machine
from metald.secrets import SecretBox
from metald.service import cancel
from metald.store.db import Store
from metald.store.models import Bmc, Machine, utcnow

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Expected:
    """The power state metald asked for, and until when a different reading is not drift."""

    state: PowerState
    until: float


class LeaseEnded(BmcError):
    """This instance's fleet lease ended (it fenced itself) before the command finished: it
    was stopped, its retries and retransmissions with it. Never retried here."""


class BmcControl:
    """Drivers, scheduler and ownership: every BMC command goes through ``_send``."""

    def __init__(self, store: Store, secrets: SecretBox, cfg: BmcConfig, instance: str) -> None:
        self.store = store
        self.secrets = secrets
        self.cfg = cfg
        self.instance = instance
        self.scheduler = BmcScheduler(
            max_concurrency=cfg.max_concurrency,
            min_interval_s=cfg.min_interval_ms / 1000,
            timeout_s=cfg.timeout_s,
            retries=cfg.retries,
            backoff_base_s=cfg.backoff_base_ms / 1000,
            backoff_cap_s=cfg.backoff_max_s,
        )
        self.drivers: dict[str, BmcDriver] = {}
        self._persisted: dict[str, tuple[str, str | None]] = {}
        #: bmc id -> what metald asked for (see power sync's drift check).
        self.expected: dict[str, Expected] = {}
        #: Fleet membership; None: this instance owns every BMC (one instance, or a test).
        self.ownership: BmcOwnership | None = None
        #: bmc id -> the generation this instance acquired it at.
        self.held: dict[str, int] = {}
        #: Machines whose provisioning step runs in this instance now (metald.provision.netboot).
        self.in_flight: set[str] = set()
        #: Power commands by id, and the tasks confirming them (``metald.bmc.power_confirm``).
        self.commands = CommandBook()
        self._confirming: set[asyncio.Task[None]] = set()

    # --- ownership ------------------------------------------------------------------------

    def owner_of(self, row: Bmc) -> str | None:
        if self.ownership is None:
            return self.instance
        return self.ownership.bmc_owner(row.id, row.address)

    def owns(self, row: Bmc) -> bool:
        return self.ownership is None or self.ownership.owns_bmc(row.id, row.address)

    async def sync_ownership(self) -> None:
        """Acquire the BMCs the rendezvous hash gives this instance, release the others (so
        their new owner can acquire them). Called each power-sync round and whenever the live
        set changes."""
        own = self.ownership
        if own is None:
            return
        if own.fenced:
            self.held.clear()
            return
        rows = await self.store.run(ownership.rows)
        mine = [r.id for r in rows if own.owns_bmc(r.id, r.address)]
        self.held = await self.store.run(
            ownership.acquire, own.instance, mine, own.dead_after_s, release_others=True
        )

    async def _generation(self, row: Bmc) -> int | None:
        """The generation to fence a command with; None without a fleet. Raises NotOwner."""
        own = self.ownership
        if own is None:
            return None
        if own.fenced:
            self.held.clear()
            raise NotOwner(
                f"this metald instance ({own.instance}) cannot reach the store and sends no "
                "BMC commands until it can; send the request to another instance",
                owner=None,
            )
        owner = own.bmc_owner(row.id, row.address)
        if owner != own.instance:
            raise NotOwner(
                f"BMC {row.id} is owned by instance {owner or '(none live)'}; its commands run "
                "there",
                owner=owner,
            )
        gen = self.held.get(row.id)
        if gen is None:
            got = await self.store.run(ownership.acquire, own.instance, [row.id], own.dead_after_s)
            gen = got.get(row.id)
            if gen is None:
                raise NotOwner(
                    f"BMC {row.id} is still held by its previous owner; ownership moves within "
                    f"{own.dead_after_s:.0f} s, try again then",
                    owner=owner,
                )
            self.held[row.id] = gen
        return gen

    async def _fence(self, row: Bmc, command: str | None, step: str | None) -> None:
        """Right before a command is sent: check in the store that this instance still holds
        the BMC, and journal a step's command as sent (before it is)."""
        gen = await self._generation(row)
        if gen is None and step is None:
            return
        own = self.ownership
        me = own.instance if own is not None else None
        # The check holds only within the lease held when it was asked (a reply delayed on a
        # cut link may arrive after the others took over): read the deadline first.
        until = own.lease_until() if own is not None else None
        ok = await self.store.run(ownership.check_and_journal, row.id, me, gen, step, command)
        if ok and until is not None and time.monotonic() >= until:
            self.held.clear()
            raise NotOwner(
                f"this metald instance ({me}) lost the store while checking BMC {row.id}: it "
                "fenced itself and sends nothing; send the request to another instance",
                owner=None,
            )
        if not ok:
            self.held.pop(row.id, None)
            raise NotOwner(f"BMC {row.id} was taken over by another instance", owner=None)

    # --- drivers --------------------------------------------------------------------------

    def make_driver(self, protocol: str, ep: BmcEndpoint) -> BmcDriver:
        # The per-request deadline sits just inside the scheduler's, so the driver names the cause.
        inner = max(0.1, self.cfg.timeout_s * 0.9)
        if protocol == "ipmi":
            return IpmiDriver(
                ep,
                request_timeout_s=inner,
                resend_s=self.cfg.ipmi_resend_ms / 1000,
                cipher_suites=tuple(self.cfg.ipmi_cipher_suites),
            )
        scheme, host = split_scheme(ep.address)
        ep2 = BmcEndpoint(host, ep.port, ep.username, ep.password, ep.verify_tls, ep.ca_cert)
        return RedfishDriver(ep2, scheme=scheme, request_timeout_s=inner)

    def driver_for(self, row: Bmc) -> BmcDriver:
        d = self.drivers.get(row.id)
        if d is None:
            ep = BmcEndpoint(
                row.address,
                row.port,
                row.username,
                self.secrets.decrypt(row.password_enc),
                row.verify_tls,
                row.ca_cert,
            )
            d = self.drivers[row.id] = self.make_driver(row.protocol, ep)
        return d

    async def forget(self, bmc_id: str) -> None:
        if (d := self.drivers.pop(bmc_id, None)) is not None:
            await d.close()
        self.scheduler.forget(bmc_id)
        self.held.pop(bmc_id, None)

    def drop_sessions(self) -> None:
        """Fenced: end every BMC session now, before the others can take the BMCs over, rather
        than at the session's idle timer (a fenced instance sends nothing after that)."""
        self.held.clear()
        drivers, self.drivers = list(self.drivers.values()), {}
        loop = asyncio.get_running_loop()
        for d in drivers:
            task = loop.create_task(d.close())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def close(self) -> None:
        for task in list(self._confirming):
            await cancel(task)
        drivers, self.drivers = list(self.drivers.values()), {}
        for d in drivers:
            with contextlib.suppress(Exception):
                await d.close()

    async def run(
        self,
        row: Bmc,
        op_name: str,
        fn: Callable[[BmcDriver], Awaitable[T]],
        *,
        idempotent: bool = True,
        timeout_s: float | None = None,
    ) -> T:
        """Run ``fn`` on the BMC's driver under the scheduler, within this instance's lease;
        raises BmcError (``LeaseEnded`` when the lease ended first)."""
        driver = self.driver_for(row)
        try:
            return await self._within_lease(
                row.id,
                self.scheduler.run(
                    row.id,
                    lambda: fn(driver),
                    name=op_name,
                    idempotent=idempotent,
                    timeout_s=timeout_s,
                ),
            )
        finally:
            await self._persist_health(row.id)

    async def _within_lease(self, bmc_id: str, work: Coroutine[Any, Any, T]) -> T:
        """Await ``work`` (a command with its retries) only while this instance holds its lease
        without a lapse: at the lease's end it is cancelled, so no retransmission or retry
        leaves after the instance fenced itself (its BMCs move 2 s later by default). A lease
        renewed in time extends the bound; one renewed after a lapse does not (the BMC may
        have moved meanwhile)."""
        own = self.ownership
        if own is None:
            return await work
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        epoch = own.lease_epoch
        expired = False
        handle: asyncio.TimerHandle | None = None

        def lease_end() -> float:
            return own.lease_until() if own.lease_epoch == epoch else 0.0

        def check() -> None:
            nonlocal handle, expired
            now = time.monotonic()
            if now < (until := lease_end()):
                handle = loop.call_later(until - now, check)
            else:
                expired = True
                task.cancel()

        if time.monotonic() >= lease_end():
            work.close()
            raise LeaseEnded(f"this instance's lease ended before the command to BMC {bmc_id}")
        check()
        try:
            return await work
        except asyncio.CancelledError:
            if expired and task.uncancel() == 0:
                raise LeaseEnded(
                    f"this instance fenced itself while a command to BMC {bmc_id} ran: it was "
                    "stopped at the lease's end (it may or may not have reached the BMC)"
                ) from None
            raise
        finally:
            if handle is not None:
                handle.cancel()

    def seed_health(self, bmc_id: str, driver: BmcDriver) -> None:
        """A BMC just registered with a driver that proved it works."""
        self.drivers[bmc_id] = driver
        self._persisted[bmc_id] = (Health.OK.value, None)

    async def _persist_health(self, bmc_id: str) -> None:
        health, detail = self.scheduler.health(bmc_id)
        if health is Health.UNKNOWN or self._persisted.get(bmc_id) == (health.value, detail):
            return
        self._persisted[bmc_id] = (health.value, detail)
        values: dict[str, Any] = {"health": health.value, "health_detail": detail}
        if health is Health.OK:
            values["last_seen_at"] = utcnow()

        def write(s: Session) -> None:
            s.execute(update(Bmc).where(Bmc.id == bmc_id).values(**values))  # type: ignore[arg-type]
            s.commit()

        await self.store.run(write)

    async def virtual_media(self, row: Bmc, op: str, *args: Any) -> Any:
        """A Redfish VirtualMedia request (``metald.bmc.virtual_media.OPERATIONS``) on the BMC;
        the caller fences and journals it first (``metald.bmc.media``)."""
        from metald.bmc import virtual_media

        fn = virtual_media.OPERATIONS[op]
        return await self._command(row, op, lambda d: fn(d, *args))  # type: ignore[arg-type]

    async def _command(
        self,
        row: Bmc,
        name: str,
        fn: Callable[[BmcDriver], Awaitable[T]],
        *,
        idempotent: bool = True,
        timeout_s: float | None = None,
    ) -> T:
        try:
            return await self.run(row, name, fn, idempotent=idempotent, timeout_s=timeout_s)
        except LeaseEnded as e:
            self.held.clear()
            raise NotOwner(f"{e}; send the request to another instance", owner=None) from None
        except BmcUnsupported as e:
            raise Unprocessable(f"{cause(e)}", bmc_id=row.id) from None
        except BmcError as e:
            health, _ = self.scheduler.health(row.id)
            hint = {
                Health.AUTH_FAILED: "; update the BMC's credentials",
                Health.UNREACHABLE: "; check the BMC's network and address",
            }.get(health, "")
            raise BmcCommandFailed(
                f"{name} on BMC {row.id} failed: {cause(e)}{hint}",
                bmc_id=row.id,
                health=health.value,
            ) from None

    # --- rows -----------------------------------------------------------------------------

    async def row_for_machine(self, machine_id: str) -> Bmc:
        def do(s: Session) -> Bmc:
            get_machine(s, machine_id)
            row = s.exec(select(Bmc).where(Bmc.machine_id == machine_id)).first()
            if row is None:
                raise NoBmc(
                    f"machine {machine_id} has no BMC; register one with "
                    "POST /api/v1/bmcs or link one by hand"
                )
            return row

        return await self.store.run(do)

    async def row(self, bmc_id: str) -> Bmc:
        return await self.store.run(get_bmc, bmc_id)

    # --- commands (PowerControl) ----------------------------------------------------------

    async def power(
        self,
        machine_id: str,
        action: PowerAction,
        *,
        actor: str = "system",
        step: str | None = None,
    ) -> PowerState:
        # Provisioning gets the state the BMC reported (the target once confirmed); a
        # command still pending after power_state_timeout_s reports its last reading.
        row = await self.row_for_machine(machine_id)
        cmd = await self.power_row(row, action, actor, step)
        return cmd.observed if cmd.observed is not None else await self.read_power_row(row)

    async def read_power(self, machine_id: str, *, actor: str = "system") -> PowerState:
        return await self.read_power_row(await self.row_for_machine(machine_id))

    async def set_boot_device(
        self,
        machine_id: str,
        device: BootTarget,
        persistent: bool = False,
        *,
        uefi: bool | None = None,
        actor: str = "system",
        step: str | None = None,
    ) -> None:
        row = await self.row_for_machine(machine_id)
        boot = BootDevice(BootTarget(device), bool(persistent), uefi)
        await self._fence(row, f"boot:{boot.device.value}", step)
        await self._command(row, "set_boot_device", lambda d: d.set_boot_device(boot))

        def record(s: Session) -> None:
            add_event(
                s,
                "bmc.boot-device",
                actor,
                machine_id=machine_id,
                instance=self.instance,
                data={
                    "bmc_id": row.id,
                    "device": boot.device.value,
                    "persistent": boot.persistent,
                    "uefi": boot.uefi,
                },
            )
            s.commit()

        await self.store.run(record)

    async def read_power_row(self, row: Bmc) -> PowerState:
        """Ask the BMC now, and record what it said (not drift: someone asked)."""
        await self._generation(row)
        state = await self._command(row, "get_power", lambda d: d.get_power())
        await self.store.run(record_power, row.id, state, None, self.instance)
        return state

    async def power_row(
        self,
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
        await self._fence(row, f"power:{act.value}", step)
        # Expected before it is sent, so a sync reading in between is not reported as drift.
        self.expected[row.id] = Expected(cmd.target, time.monotonic() + self.cfg.drift_grace_s)
        await self._command(
            row,
            f"power_{act.value}",
            lambda d: d.set_power(act),
            idempotent=act not in (PowerAction.CYCLE, PowerAction.RESET),
        )
        self.commands.add(cmd)
        task = asyncio.create_task(self._confirm(row, cmd, actor), name=f"bmc-confirm-{cmd.id}")
        self._confirming.add(task)
        task.add_done_callback(self._confirming.discard)
        wait = self.cfg.power_state_timeout_s
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
                instance=self.instance,
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

        await self.store.run(record)
        if cmd.status is CommandStatus.FAILED:
            raise BmcCommandFailed(
                f"power {act.value} on BMC {row.id}: the BMC accepted it but did not report "
                f"power {cmd.target.value} within {self.cfg.power_state_give_up_s:g} s "
                f"(last reading: {cmd.observed.value if cmd.observed else 'none'}); check the "
                "machine's power supply and the BMC",
                bmc_id=row.id,
                command_id=cmd.id,
            )
        return cmd

    async def _confirm(self, row: Bmc, cmd: PowerCommand, actor: str) -> None:
        """Read the BMC (backing off) until it reports the command's target state or
        ``power_state_give_up_s`` passed; record each reading; when the request already
        answered 202, report the outcome as an event."""

        async def reading(state: PowerState) -> None:
            cmd.last_error = None
            if state is not cmd.observed:
                cmd.observed = state
                await self.store.run(record_power, row.id, state, None, self.instance)

        def failed_read(e: Exception) -> None:
            cmd.last_error = cause(e)

        cmd.status = await wait_for_state(
            lambda: self.run(row, "confirm_power", lambda d: d.get_power()),
            cmd.target,
            cmd.sent_at + self.cfg.power_state_give_up_s,
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
                instance=self.instance,
                reason=(
                    f"the BMC did not report power {cmd.target.value} within "
                    f"{self.cfg.power_state_give_up_s:g} s of power {cmd.action.value}"
                    if failed
                    else None
                ),
                data=cmd.public(),
            )
            s.commit()

        await self.store.run(record)

    async def set_locate(self, machine_id: str, on: bool, *, actor: str = "system") -> bool | None:
        """Light (or turn off) the machine's locate indicator; returns what the BMC reports
        afterwards (None where it does not say)."""
        row = await self.row_for_machine(machine_id)
        await self._fence(row, None, None)
        await self._command(row, "set_locate", lambda d: d.set_locate(on))
        state = await self._read_locate(row)

        def record(s: Session) -> None:
            add_event(
                s,
                "bmc.locate",
                actor,
                machine_id=machine_id,
                instance=self.instance,
                data={"bmc_id": row.id, "on": on, "reported": state},
            )
            s.commit()

        await self.store.run(record)
        return state

    async def read_locate(self, machine_id: str) -> bool | None:
        row = await self.row_for_machine(machine_id)
        await self._generation(row)
        return await self._read_locate(row)

    async def _read_locate(self, row: Bmc) -> bool | None:
        try:
            return await self._command(row, "get_locate", lambda d: d.get_locate())
        except Unprocessable:  # the BMC lights it but cannot say whether it is lit
            return None

    async def sensors(self, machine_id: str) -> list[Sensor]:
        row = await self.row_for_machine(machine_id)
        await self._generation(row)
        return await self._command(
            row, "sensors", lambda d: d.sensors(), timeout_s=self.cfg.sensors_timeout_s
        )

    async def event_log(self, machine_id: str) -> list[LogEntry]:
        row = await self.row_for_machine(machine_id)
        await self._generation(row)
        return await self._command(
            row, "event_log", lambda d: d.event_log(), timeout_s=self.cfg.sensors_timeout_s
        )


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
    current = s.get(Bmc, bmc_id)
    if current is None:
        return False
    before = current.power_state
    if before == observed.value:
        return False
    drift = drift_actor is not None and before is not None
    if drift:
        add_event(
            s,
            "bmc.power-drift",
            drift_actor or "",
            machine_id=current.machine_id,
            from_state=before,
            to_state=observed.value,
            instance=instance,
            reason="power state changed without a metald command",
            data={"bmc_id": bmc_id},
        )
    set_power(s, bmc_id, current.machine_id, observed)
    s.commit()
    return drift


def get_bmc(s: Session, bmc_id: str) -> Bmc:
    row = s.get(Bmc, bmc_id)
    if row is None:
        raise NotFound(f"no BMC with id {bmc_id!r}")
    return row


def split_scheme(address: str) -> tuple[str, str]:
    for scheme in ("https", "http"):
        if address.startswith(scheme + "://"):
            return scheme, address[len(scheme) + 3 :].rstrip("/")
    return "https", address


def cause(e: BaseException) -> str:
    return str(e) or type(e).__name__
