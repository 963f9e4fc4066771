"""The ``bmc`` daemon service: the registry, the commands and power sync of one instance, and
the answers the API gives about them.

The jobs live in their own modules: ``registry`` (the ``bmcs`` rows, linking to machines),
``executor`` (the one fenced way a command is sent, and the ``PowerControl`` provisioning
calls), one module per group of capabilities (``chassis``: power, boot device, locate light;
``firmware``: firmware and BIOS; ``media``: virtual media; sensors and the event log are one
``execute`` each) and ``power_sync`` (the periodic reading and drift). This class wires them and
shapes their typed results into the API's dicts, each BMC with the capabilities its driver
offers.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, ParamSpec

from sqlmodel import Session

from metald.bmc import chassis, firmware, media, secureboot
from metald.bmc.base import BmcError, BootTarget, PowerAction
from metald.bmc.capabilities import Capability
from metald.bmc.control import BmcCommandFailed, BmcOwnership, NoBmc, NotOwner
from metald.bmc.executor import BmcExecutor, capabilities_of
from metald.bmc.power_sync import PowerSync
from metald.bmc.registry import PROTOCOLS, BmcRegistry, link_by_identity_in, public
from metald.config import BmcConfig
from metald.errors import MetaldError, NotFound, Unprocessable
from metald.secrets import SecretBox
from metald.service import TaskScope
from metald.store.db import Store
from metald.store.models import Bmc

log = logging.getLogger(__name__)

__all__ = ["PROTOCOLS", "BmcCommandFailed", "BmcService", "NoBmc", "NotOwner"]


P = ParamSpec("P")


def _shown_after(
    step: Callable[Concatenate[BmcRegistry, P], Awaitable[Bmc]],
) -> Callable[Concatenate[BmcService, P], Awaitable[dict[str, Any]]]:
    """A registry step as a method of the service: same arguments, the row it answers shown
    (``_shown``)."""

    async def call(self: BmcService, /, *args: P.args, **kwargs: P.kwargs) -> dict[str, Any]:
        return _shown(await step(self.registry, *args, **kwargs))

    call.__doc__ = step.__doc__
    return call


class BmcService:
    name = "bmc"

    def __init__(
        self,
        store: Store,
        secrets: SecretBox,
        cfg: BmcConfig,
        instance: str,
        *,
        ownership: BmcOwnership | None = None,
        vmedia_base: str | None = None,
        tasks: TaskScope | None = None,
    ) -> None:
        self.store = store
        self.secrets = secrets
        self.cfg = cfg
        self.instance = instance
        self.actor = f"metald:{instance}"
        #: The fenced executor every command goes through (also provisioning's PowerControl).
        self.control = BmcExecutor(store, secrets, cfg, instance)
        self.registry = BmcRegistry(store, self.control, instance)
        self.control.ownership = ownership  # the fleet: which BMCs this instance commands
        if vmedia_base is not None:
            # Where BMCs fetch the boot ISO (read by metald.bmc.media).
            self.control.vmedia_base = vmedia_base
        self.sync = PowerSync(self.control, cfg.power_sync_interval_s, self.actor)
        #: The background work after inspections and reports; stopped with the service.
        self.tasks = tasks if tasks is not None else TaskScope(self.name)

    @property
    def ownership(self) -> BmcOwnership | None:
        return self.control.ownership

    @ownership.setter
    def ownership(self, value: BmcOwnership | None) -> None:
        self.control.ownership = value

    @property
    def scheduler(self) -> Any:
        return self.control.scheduler

    def _public(self, row: Bmc) -> dict[str, Any]:
        return {**_shown(row), "owner_instance": self.control.owner_of(row)}

    # --- lifecycle ---

    async def start(self) -> None:
        await self.tasks.open()
        await self.sync.start()

    async def stop(self) -> None:
        await self.tasks.close()
        await self.sync.stop()
        await self.control.close()

    def wake(self) -> None:
        """The fleet's live set changed: settle BMC ownership now."""
        if self.ownership is not None and self.ownership.fenced:
            self.control.drop_sessions()  # without the store: the sync round may hang on it
        self.sync.wake()

    # --- registry ---

    #: ``BmcRegistry.register`` (its arguments: connect, store, link), answering the BMC as
    #: the API shows it.
    register = _shown_after(BmcRegistry.register)

    async def link(
        self, bmc_id: str, machine_id: str | None, actor: str = "system"
    ) -> dict[str, Any]:
        return _shown(await self.registry.link(bmc_id, machine_id, actor))

    async def link_by_identity(
        self, machine_id: str, actor: str = "system"
    ) -> dict[str, Any] | None:
        row = await self.registry.link_by_identity(machine_id, actor)
        return _shown(row) if row else None

    def link_by_identity_in(self, s: Session, machine_id: str, *, actor: str) -> bool:
        """``registry.link_by_identity_in`` in the caller's transaction (it commits), after the
        caller's ``link_probe`` found the machine unlinked and a BMC free: whether one was
        linked."""
        return link_by_identity_in(s, machine_id, actor, self.instance, probed=True) is not None

    async def remove(self, bmc_id: str, actor: str = "system") -> None:
        await self.registry.remove(bmc_id, actor)

    async def list(self) -> list[dict[str, Any]]:
        return [self._public(r) for r in await self.registry.list()]

    async def get(self, bmc_id: str) -> dict[str, Any]:
        return self._public(await self.registry.get(bmc_id))

    async def owner_url(
        self, *, machine_id: str | None = None, bmc_id: str | None = None
    ) -> str | None:
        """The API URL of the live instance that owns this BMC, when that is not this one
        (the API forwards the command there); None: run it here."""
        own = self.control.ownership
        if own is None:
            return None
        try:
            row = (
                await self.control.row(bmc_id)
                if bmc_id is not None
                else await self.control.row_for_machine(machine_id or "")
            )
        except Exception:  # noqa: BLE001 - not found: answered here, with the local error
            return None
        owner = own.bmc_owner(row.id, row.address)
        if owner is None or owner == own.instance:
            return None
        members = getattr(own, "members", [])
        return next((m.api_url for m in members if m.name == owner and m.api_url), None)

    # --- commands, as the API answers them ---

    async def power(
        self, machine_id: str, action: str, actor: str = "system", wait_s: float | None = None
    ) -> dict[str, Any]:
        """Run a power action (on, off, cycle, soft-off) or ``status``; returns the state the
        BMC reported and, for an action, its command (``status`` pending: not yet reported)."""
        row = await self.control.row_for_machine(machine_id)
        return await self._power(row, machine_id, action, actor, wait_s)

    async def power_bmc(
        self, bmc_id: str, action: str, actor: str = "system", wait_s: float | None = None
    ) -> dict[str, Any]:
        """The same through the BMC itself: powers on hosts that have not enrolled yet (their
        machine appears when they PXE-boot, and the BMC is then linked by identity)."""
        row = await self.control.row(bmc_id)
        return await self._power(row, row.machine_id, action, actor, wait_s)

    def power_command(
        self, command_id: str, *, machine_id: str | None = None, bmc_id: str | None = None
    ) -> dict[str, Any]:
        """A power command this instance sent, by id (recent ones; older ones are events)."""
        cmd = self.control.commands.get(command_id)
        if (
            cmd is None
            or (machine_id is not None and cmd.machine_id != machine_id)
            or (bmc_id is not None and cmd.bmc_id != bmc_id)
        ):
            raise NotFound(
                f"no recent power command {command_id!r} here; its outcome is in the events "
                "(bmc.power, bmc.power-confirmed, bmc.power-failed)"
            )
        return cmd.public()

    async def _power(
        self,
        row: Bmc,
        machine_id: str | None,
        action: str,
        actor: str,
        wait_s: float | None = None,
    ) -> dict[str, Any]:
        if action == "status":
            state = await chassis.read_power_row(self.control, row)
            return {"machine_id": machine_id, "bmc_id": row.id, "power_state": state.value}
        try:
            act = PowerAction(action)
        except ValueError:
            raise Unprocessable(
                f"unknown power action {action!r}; use one of status, "
                + ", ".join(a.value for a in PowerAction)
            ) from None
        cmd = await chassis.power_row(self.control, row, act, actor, wait_s=wait_s)
        return {**cmd.public(), "machine_id": machine_id}

    async def set_boot_device(
        self,
        machine_id: str,
        device: str,
        persistent: bool = False,
        uefi: bool | None = True,
        actor: str = "system",
    ) -> dict[str, Any]:
        try:
            target = BootTarget(device)
        except ValueError:
            raise Unprocessable(f"boot device must be pxe or disk, not {device!r}") from None
        uefi = None if uefi is None else bool(uefi)
        await self.control.set_boot_device(
            machine_id, target, bool(persistent), uefi=uefi, actor=actor
        )
        return {
            "machine_id": machine_id,
            "device": target.value,
            "persistent": bool(persistent),
            "uefi": uefi,
        }

    async def locate(
        self, machine_id: str, on: bool | None, actor: str = "system"
    ) -> dict[str, Any]:
        """Turn the locate light on or off (``on`` None: only read it)."""
        row = await self.control.row_for_machine(machine_id)
        if on is None:
            state = await chassis.read_locate(self.control, row)
        else:
            state = await chassis.set_locate(self.control, row, on, actor=actor)
        return {"machine_id": machine_id, "bmc_id": row.id, "on": state}

    async def firmware(self, machine_id: str, actor: str = "system") -> dict[str, Any]:
        """Read the firmware inventory now and record it on the machine."""
        items = await firmware.refresh_firmware(self.control, machine_id, actor)
        return {
            "machine_id": machine_id,
            "items": [
                {"id": i.id, "name": i.name, "version": i.version, "updateable": i.updateable}
                for i in items
            ],
        }

    async def bios(self, machine_id: str, actor: str = "system") -> dict[str, Any]:
        """Read the BIOS settings now; record them and their drift from the profile."""
        return {
            "machine_id": machine_id,
            **await firmware.read_bios(self.control, machine_id, actor),
        }

    async def set_bios(
        self, machine_id: str, attributes: dict[str, Any], actor: str = "system"
    ) -> dict[str, Any]:
        """Make ``attributes`` the machine's desired profile and stage what differs."""
        out = await firmware.stage_bios(self.control, machine_id, attributes, actor)
        return {"machine_id": machine_id, **out}

    async def secure_boot(self, machine_id: str, actor: str = "system") -> dict[str, Any]:
        """Read the machine's Secure Boot state now and record it."""
        return {"machine_id": machine_id, **await secureboot.read(self.control, machine_id, actor)}

    async def set_secure_boot(
        self, machine_id: str, *, enable: bool, enroll: bool, actor: str = "system"
    ) -> dict[str, Any]:
        """Enroll metald's certificate in db (``enroll``) and write SecureBootEnable."""
        out = await secureboot.configure(
            self.control, machine_id, enable, enroll, self.cfg.secure_boot_cert, actor
        )
        return {"machine_id": machine_id, **out}

    def after_inspection(self, machine_id: str) -> None:
        """A machine's inventory was just accepted: record its firmware versions and stage its
        BIOS profile in the background (its next reboot applies it). Best effort: a BMC that
        offers neither, or no BMC, changes nothing."""
        self.tasks.start_soon(self._after_inspection(machine_id), name="bmc-inspection")

    def after_report(self, machine_id: str) -> None:
        """A machine's agent ended its boot's work (a provision or wipe done or failed): eject
        a virtual-media boot's ISO in the background (``media.eject_after_report``)."""
        self.tasks.start_soon(
            media.eject_after_report(self.control, machine_id, self.actor), name="bmc-eject"
        )

    async def _after_inspection(self, machine_id: str) -> None:
        # One read first (off the writer): most machines (a power-on storm's all) have no
        # virtual-media ISO in and no BMC, and then there is nothing to do.
        image, has_bmc = await self.store.read_aside(media.after_inspection_probe, machine_id)
        steps: list[Callable[[], Awaitable[Any]]] = []
        if image is not None:
            steps.append(lambda: media.eject_after_report(self.control, machine_id, self.actor))
        if has_bmc:
            steps.append(lambda: firmware.refresh_firmware(self.control, machine_id, self.actor))
            steps.append(lambda: firmware.stage_bios(self.control, machine_id, None, self.actor))
            steps.append(lambda: self._secure_boot_if_offered(machine_id))
        for step in steps:
            try:
                await step()
            except (MetaldError, BmcError) as e:
                log.info("machine %s: after inspection: %s", machine_id, e)

    async def _secure_boot_if_offered(self, machine_id: str) -> None:
        row = await self.control.row_for_machine(machine_id)
        if Capability.SECURE_BOOT in capabilities_of(row.protocol):
            await secureboot.read(self.control, machine_id, self.actor)

    async def sensors(self, machine_id: str) -> builtins.list[dict[str, Any]]:
        row = await self.control.row_for_machine(machine_id)
        got = await self.control.execute(
            row,
            Capability.SENSORS,
            "sensors",
            lambda d: d.sensors(),
            timeout_s=self.cfg.sensors_timeout_s,
        )
        return [
            {"name": x.name, "kind": x.kind, "value": x.value, "units": x.unit, "health": x.health}
            for x in got
        ]

    async def event_log(self, machine_id: str) -> builtins.list[dict[str, Any]]:
        return [
            {
                "id": e.id,
                "at": e.at.isoformat() if e.at else None,
                "severity": e.severity,
                "message": e.message,
            }
            for e in await self.control.execute(
                await self.control.row_for_machine(machine_id),
                Capability.EVENT_LOG,
                "event_log",
                lambda d: d.event_log(),
                timeout_s=self.cfg.sensors_timeout_s,
            )
        ]

    async def event_log_stamp(self, machine_id: str) -> str | None:
        """What changes whenever the machine's BMC event log does (one small read), or None
        where its driver cannot say: then only ``event_log`` tells."""

        async def stamp(d: Any) -> str | None:
            read = getattr(d, "event_log_stamp", None)
            return None if read is None else str(await read())

        return await self.control.execute(
            await self.control.row_for_machine(machine_id),
            Capability.EVENT_LOG,
            "event_log_stamp",
            stamp,
            timeout_s=self.cfg.sensors_timeout_s,
        )

    # --- event push (Redfish EventService) ---

    async def event_subscribe(self, machine_id: str, destination: str, secret: str) -> str | None:
        """Subscribe ``destination`` to the BMC's log events (``EventPush.event_subscribe``)."""
        return await self.control.execute(
            await self.control.row_for_machine(machine_id),
            Capability.EVENT_PUSH,
            "event_subscribe",
            lambda d: d.event_subscribe(destination, secret),
            timeout_s=self.cfg.sensors_timeout_s,
        )

    async def event_subscription_alive(self, machine_id: str, uri: str) -> bool:
        return await self.control.execute(
            await self.control.row_for_machine(machine_id),
            Capability.EVENT_PUSH,
            "event_subscription_alive",
            lambda d: d.event_subscription_alive(uri),
            timeout_s=self.cfg.sensors_timeout_s,
        )

    async def event_unsubscribe(self, machine_id: str, uri: str) -> None:
        await self.control.execute(
            await self.control.row_for_machine(machine_id),
            Capability.EVENT_PUSH,
            "event_unsubscribe",
            lambda d: d.event_unsubscribe(uri),
            timeout_s=self.cfg.sensors_timeout_s,
        )

    # --- power sync ---

    async def sync_power_once(self) -> int:
        return await self.sync.sync_power_once()


def _shown(row: Bmc) -> dict[str, Any]:
    """The BMC as the API shows it, with what its driver can be asked."""
    return {**public(row), "capabilities": sorted(c.value for c in capabilities_of(row.protocol))}
