"""The one way a BMC command is sent: ``BmcExecutor.execute``.

It refuses a capability the BMC's driver lacks (``metald.bmc.capabilities``), confirms this
instance still holds the BMC (lease, fencing generation), journals a provisioning step's command
before it is sent, runs it under the scheduler (serialised per BMC, timeouts, retries, health)
within the lease, and maps what went wrong onto the API's problems. The commands themselves are
the capability modules' (``chassis``, ``firmware``, ``media``); the executor also owns the
per-BMC driver sessions and their health, and is the ``PowerControl`` provisioning calls. With several instances (metald.fleet) a command is sent only by the
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
from typing import Any, TypeVar

from sqlalchemy import update
from sqlmodel import Session, select

from metald.bmc import chassis, ownership
from metald.bmc.base import (
    BmcDriver,
    BmcEndpoint,
    BmcError,
    BmcUnsupported,
    cause,
)
from metald.bmc.capabilities import Capability, CapabilityMissing
from metald.bmc.control import BmcCommandFailed, BmcOwnership, Expected, NoBmc, NotOwner
from metald.bmc.ipmi import IpmiDriver
from metald.bmc.power_confirm import CommandBook
from metald.bmc.redfish import RedfishDriver
from metald.bmc.scheduler import BmcScheduler, Health
from metald.config import BmcConfig
from metald.errors import NotFound, Unprocessable
from metald.machines import get_machine
from metald.secrets import SecretBox
from metald.service import cancel
from metald.store.db import Store
from metald.store.models import Bmc, utcnow

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The driver of each protocol.
DRIVERS: dict[str, type[IpmiDriver] | type[RedfishDriver]] = {
    "ipmi": IpmiDriver,
    "redfish": RedfishDriver,
}


def capabilities_of(protocol: str) -> frozenset[Capability]:
    """What a BMC of this protocol can be asked (none for a protocol metald has no driver of)."""
    driver = DRIVERS.get(protocol)
    return frozenset(Capability(c) for c in driver.capabilities) if driver else frozenset()


class LeaseEnded(BmcError):
    """This instance's fleet lease ended (it fenced itself) before the command finished: it
    was stopped, its retries and retransmissions with it. Never retried here."""


class BmcExecutor:
    """Drivers, scheduler and ownership: every BMC command goes through ``execute``."""

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
        #: The boot HTTP listener's URL, where BMCs fetch a boot's ISO (``metald.bmc.media``).
        self.vmedia_base: str | None = None
        #: Machines whose provisioning step runs in this instance now (metald.provision.netboot).
        self.in_flight: set[str] = set()
        #: Power commands by id, and the tasks confirming them (``metald.bmc.power_confirm``).
        self.commands = CommandBook()
        self._background: set[asyncio.Task[None]] = set()
        self._settling = asyncio.Lock()

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
        # On the ownership's own lane (thread and connection): a storm's request work queued
        # on the store's pool must not hold up a dead instance's BMCs' takeover. One settle at
        # a time (each acquisition raises a BMC's generation: two at once would leave
        # ``held`` with the older one). Bounded by the age that makes an instance dead.
        async with self._settling:
            rows = await self.store.lane("own", ownership.rows, timeout_s=own.dead_after_s)
            mine = [r.id for r in rows if own.owns_bmc(r.id, r.address)]
            self.held = await self.store.lane(
                "own",
                ownership.acquire,
                own.instance,
                mine,
                own.dead_after_s,
                release_others=True,
                timeout_s=own.dead_after_s,
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
        power = command is not None and command.startswith("power:")
        if gen is None and step is None and not power:
            return  # (a power command is checked even so: never during a firmware flash)
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

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run ``work`` (a power command's confirmation) in the background until ``close``."""
        task = asyncio.create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def close(self) -> None:
        for task in list(self._background):
            await cancel(task)
        drivers, self.drivers = list(self.drivers.values()), {}
        for d in drivers:
            with contextlib.suppress(Exception):
                await d.close()

    async def run(
        self,
        row: Bmc,
        op_name: str,
        fn: Callable[[Any], Awaitable[T]],
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

    def require(self, row: Bmc, capability: Capability, hint: str = "") -> None:
        """Raise ``CapabilityMissing`` (422, naming it) unless the BMC's driver offers it."""
        offered = capabilities_of(row.protocol)
        if capability not in offered:
            raise CapabilityMissing(row.id, row.protocol, capability, offered, hint)

    async def execute(
        self,
        row: Bmc,
        capability: Capability,
        name: str,
        fn: Callable[[Any], Awaitable[T]],
        *,
        write: bool = False,
        journal: str | None = None,
        step: str | None = None,
        before_send: Callable[[], None] | None = None,
        idempotent: bool = True,
        timeout_s: float | None = None,
    ) -> T:
        """Send one command: ``fn`` on the BMC's driver (which implements ``capability``).

        A read only needs this instance to own the BMC; a ``write`` is fenced in the store
        first, and a provisioning ``step``'s ``journal`` entry (``power:on``, ``boot:pxe``)
        recorded as sent before it is. ``before_send`` runs after the fence, right before the
        command leaves. Raises ``CapabilityMissing``, ``NotOwner``, ``Unprocessable`` (the BMC
        does not offer it after all) or ``BmcCommandFailed``."""
        self.require(row, capability)
        if write or journal is not None or step is not None:
            await self._fence(row, journal, step)
        else:
            await self._generation(row)
        if before_send is not None:
            before_send()
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

    # --- PowerControl, as provisioning calls it: the chassis commands on this executor ---

    power = chassis.power
    read_power = chassis.read_power
    set_boot_device = chassis.set_boot_device


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
