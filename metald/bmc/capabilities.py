"""What a BMC can do, one interface per capability, and the refusal when it cannot.

A driver (``metald.bmc.ipmi``, ``metald.bmc.redfish``) implements the interfaces below that its
protocol carries and names them in ``capabilities``; nothing else is asked of it. The executor
(``metald.bmc.executor``) checks the capability before it fences or sends anything, so a
command a BMC's driver lacks is refused with a problem that names the capability
(``CapabilityMissing``), never tried on the off chance. A capability the driver has but the
particular BMC turns out not to offer (a Redfish BMC without a virtual CD) is still the BMC's
answer (``BmcUnsupported``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from metald.bmc.base import (
    BiosSettings,
    BmcAccount,
    BootDevice,
    FirmwareItem,
    LogEntry,
    PowerAction,
    PowerState,
    SecureBootState,
    Sensor,
    UpdateTask,
)
from metald.errors import Unprocessable


class Capability(StrEnum):
    POWER = "power"
    BOOT_DEVICE = "boot-device"
    INDICATOR = "indicator"
    SENSORS = "sensors"
    EVENT_LOG = "event-log"
    #: Push of event-log entries (Redfish EventService subscriptions; ``metald.healthwatch``).
    EVENT_PUSH = "event-push"
    FIRMWARE = "firmware"
    FIRMWARE_UPDATE = "firmware-update"
    ACCOUNTS = "accounts"
    BIOS = "bios"
    #: UEFI Secure Boot: read it, enable it, enroll a db certificate (Redfish ``SecureBoot``).
    SECURE_BOOT = "secure-boot"
    VIRTUAL_MEDIA = "virtual-media"
    SERIAL_CONSOLE = "serial-console"


@runtime_checkable
class Power(Protocol):
    async def get_power(self) -> PowerState: ...

    async def set_power(self, action: PowerAction) -> None: ...


@runtime_checkable
class BootDeviceControl(Protocol):
    async def set_boot_device(self, boot: BootDevice) -> None: ...


@runtime_checkable
class Indicator(Protocol):
    async def set_locate(self, on: bool) -> None:
        """Turn the chassis identify light on (until turned off) or off."""

    async def get_locate(self) -> bool | None:
        """Whether the locate light is on; None where the BMC does not say."""


@runtime_checkable
class Sensors(Protocol):
    async def sensors(self) -> list[Sensor]: ...


@runtime_checkable
class EventLog(Protocol):
    async def event_log(self) -> list[LogEntry]: ...


@runtime_checkable
class EventPush(Protocol):
    async def event_subscribe(self, destination: str, secret: str) -> str | None:
        """Subscribe ``destination`` to the BMC's log events, sending ``secret`` with each;
        the subscription's URI, or None where the BMC offers no event service."""

    async def event_subscription_alive(self, uri: str) -> bool: ...

    async def event_unsubscribe(self, uri: str) -> None: ...


@runtime_checkable
class Firmware(Protocol):
    async def firmware_inventory(self) -> list[FirmwareItem]: ...


@runtime_checkable
class FirmwareUpdate(Protocol):
    """Flash a firmware component through the BMC (Redfish ``UpdateService``)."""

    async def update_methods(self) -> frozenset[str]:
        """What the BMC offers: "simple-update" (it pulls the image by URL), "multipart" (the
        image is pushed to it); BmcUnsupported when neither."""

    async def simple_update(self, image_url: str, item: str) -> UpdateTask:
        """Ask the BMC to fetch ``image_url`` and flash inventory ``item``; its task."""

    async def push_update(self, image: bytes, item: str, marker: str) -> UpdateTask:
        """Push ``image`` for ``item`` (``marker`` rides in the request, to find it again)."""

    async def update_task(self, uri: str) -> UpdateTask: ...

    async def find_update_task(self, marker: str) -> UpdateTask | None:
        """The BMC's task whose request carries ``marker`` (None: the BMC has none)."""

    async def reset_bmc(self) -> None:
        """Restart the BMC itself (its own new firmware takes effect)."""


@runtime_checkable
class Accounts(Protocol):
    """The BMC's user accounts (Redfish ``AccountService``)."""

    async def accounts(self) -> list[BmcAccount]: ...

    async def delete_account(self, account_id: str) -> None: ...


@runtime_checkable
class Bios(Protocol):
    async def bios(self) -> BiosSettings: ...

    async def set_bios_pending(self, attributes: dict[str, Any]) -> None:
        """Stage BIOS attributes; the firmware applies them at its next boot."""


@runtime_checkable
class SecureBoot(Protocol):
    async def secure_boot(self) -> SecureBootState: ...

    async def set_secure_boot(self, enable: bool) -> None:
        """Write ``SecureBootEnable``; the firmware acts on it at its next boot."""

    async def enroll_certificate(self, database: str, pem: str) -> bool:
        """Add a PEM certificate to ``database`` (PK, KEK, db, dbx); False when it was there."""


@runtime_checkable
class VirtualMedia(Protocol):
    async def find_virtual_cd(self) -> tuple[str, dict[str, Any]]:
        """The device that takes a CD (its path and resource); BmcUnsupported when none."""

    async def insert_media(self, image_url: str) -> str:
        """Insert ``image_url`` (ejecting what was there); the device's path once inserted."""

    async def eject_media(self) -> None: ...

    async def boot_cd_once(self) -> None:
        """The next boot (only) from the virtual CD."""


@runtime_checkable
class ConsoleLink(Protocol):
    """One serial console (``metald.bmc.sol_link.SolLink`` is one): bytes in through
    ``on_data``, out through ``write``; ``closed`` resolves with the reason it ended."""

    took_over: bool
    closed: asyncio.Future[str] | None

    async def open(self) -> None: ...

    def write(self, data: bytes) -> None: ...

    def send_break(self) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class SerialConsole(Protocol):
    def serial_console(self, on_data: Callable[[bytes], None], *, timeout_s: float) -> ConsoleLink:
        """A console link of its own (not the command session: a console stays open for
        hours, and commands must not queue behind it), not yet opened."""


#: The interface each capability stands for.
INTERFACES: dict[Capability, type] = {
    Capability.POWER: Power,
    Capability.BOOT_DEVICE: BootDeviceControl,
    Capability.INDICATOR: Indicator,
    Capability.SENSORS: Sensors,
    Capability.EVENT_LOG: EventLog,
    Capability.EVENT_PUSH: EventPush,
    Capability.FIRMWARE: Firmware,
    Capability.FIRMWARE_UPDATE: FirmwareUpdate,
    Capability.ACCOUNTS: Accounts,
    Capability.BIOS: Bios,
    Capability.SECURE_BOOT: SecureBoot,
    Capability.VIRTUAL_MEDIA: VirtualMedia,
    Capability.SERIAL_CONSOLE: SerialConsole,
}


class CapabilityMissing(Unprocessable):
    """The BMC's driver does not implement a capability: refused before anything is sent."""

    title = "BMC lacks this capability"

    def __init__(
        self,
        bmc_id: str,
        protocol: str,
        capability: Capability,
        offered: frozenset[Capability],
        hint: str = "",
    ) -> None:
        listed = ", ".join(sorted(c.value for c in offered)) or "none"
        super().__init__(
            f"BMC {bmc_id} speaks {protocol}, which has no {capability.value} capability "
            f"(it offers: {listed}){'; ' + hint if hint else ''}",
            bmc_id=bmc_id,
            capability=capability.value,
        )
        self.capability = capability
