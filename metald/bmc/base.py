"""What every BMC driver is (``BmcDriver``), its value types and its errors; what each can do
beyond that is one interface per capability (``metald.bmc.capabilities``).

Drivers know one protocol and nothing else: no store, no retries, no scheduling. The scheduler
(``metald.bmc.scheduler``) wraps them with serialisation, timeouts, retries and health; the
service (``metald.bmc.service``) maps them onto machines. Errors are precise so the scheduler can
decide what is worth retrying: an auth failure never is, a timeout usually is.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any


class PowerState(StrEnum):
    ON = "on"
    OFF = "off"


class PowerAction(StrEnum):
    ON = "on"
    OFF = "off"  # hard off, immediately
    CYCLE = "cycle"  # off then on (a reset where the BMC has no real cycle)
    RESET = "reset"  # hard reset without removing power
    SOFT_OFF = "soft-off"  # ask the OS to shut down (ACPI)


class BootTarget(StrEnum):
    PXE = "pxe"
    DISK = "disk"


@dataclass(frozen=True)
class BootDevice:
    device: BootTarget
    #: False: the next boot only (then the BMC forgets it); True: every boot.
    persistent: bool = False
    #: UEFI boot; False means legacy BIOS; None leaves the firmware's mode as it is (Redfish;
    #: IPMI has no such value and sends legacy).
    uefi: bool | None = True


@dataclass(frozen=True)
class Sensor:
    name: str
    #: temperature, fan, power, voltage, current, other.
    kind: str
    value: float | None
    unit: str | None
    #: ok, warning, critical, unknown.
    health: str = "unknown"


@dataclass(frozen=True)
class LogEntry:
    id: str
    at: datetime | None
    severity: str
    message: str


@dataclass(frozen=True)
class FirmwareItem:
    """One entry of the BMC's firmware inventory (BMC, BIOS, NIC, GPU where exposed)."""

    id: str
    name: str
    version: str | None
    updateable: bool | None = None


@dataclass(frozen=True)
class BmcAccount:
    """One user account of the BMC (Redfish ``ManagerAccount``)."""

    id: str
    username: str
    role: str | None = None
    enabled: bool | None = None


@dataclass(frozen=True)
class UpdateTask:
    """A BMC's update task as last read (Redfish ``Task``): where to read it again, its state
    (New, Starting, Running, Completed, Exception, Killed, Cancelled, ...), how far it is, and
    its last messages."""

    uri: str
    state: str
    percent: int | None = None
    messages: tuple[str, ...] = ()
    #: The request that started it (``Payload.JsonBody``), for finding it again after a crash.
    request: str = ""

    @property
    def done(self) -> bool:
        return self.state in ("Completed", "Exception", "Killed", "Cancelled")

    @property
    def ok(self) -> bool:
        return self.state == "Completed"


@dataclass(frozen=True)
class BiosSettings:
    """The firmware's current attributes, and those pending until its next boot."""

    current: dict[str, Any]
    pending: dict[str, Any]


@dataclass(frozen=True)
class SecureBootState:
    """A system's UEFI Secure Boot as its BMC reports it (Redfish ``SecureBoot``)."""

    #: ``SecureBootEnable``: the firmware is told to enforce it (from its next boot).
    enabled: bool | None
    #: ``SecureBootCurrentBoot`` == Enabled: the running boot was verified.
    current_boot: bool | None
    #: ``SecureBootMode``: SetupMode (no PK), UserMode, AuditMode, DeployedMode.
    mode: str | None
    #: Database id (PK, KEK, db, dbx) -> SHA-256 fingerprints (upper-case hex) of its
    #: certificates, where the BMC lists them.
    certificates: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class SystemIdentity:
    """What a BMC says about the system it manages: what registration links a machine by."""

    system_uuid: str | None = None
    serial: str | None = None
    macs: list[str] = field(default_factory=list)
    #: Reset types the BMC advertised (Redfish) or None where the protocol has a fixed set.
    extra: dict[str, Any] = field(default_factory=dict)


class BmcError(Exception):
    """A BMC command failed. Messages name the BMC and the cause, and never carry credentials."""

    #: Whether trying the same command again may succeed.
    retryable = False
    #: Whether the BMC may have received (and acted on) the command despite the failure.
    maybe_delivered = False


def cause(e: BaseException) -> str:
    """What went wrong, in words (an error's message, or its type where it has none)."""
    return str(e) or type(e).__name__


class BmcAuthError(BmcError):
    """The BMC refused the credentials. Never retried: it would only lock the account."""


class BmcUnreachable(BmcError):
    """No answer at the transport level (refused, no route, TLS failure, no reply at all)."""

    retryable = True


class BmcTimeout(BmcError):
    """The BMC accepted the conversation but did not finish the command in time."""

    retryable = True


class BmcProtocolError(BmcError):
    """The BMC answered something this driver cannot use (bad reply, error completion code)."""

    retryable = True


class BmcUnsupported(BmcError):
    """The BMC does not offer this operation (e.g. a reset type it does not advertise)."""


class BmcDriver(abc.ABC):
    """One BMC, one protocol. Methods are coroutines; none of them retries.

    Beyond logging in (``identify``) a driver implements the capability interfaces of
    ``metald.bmc.capabilities`` its protocol carries, and names them in ``capabilities``: the
    executor sends a driver only what it advertises."""

    protocol: str = ""
    #: The ``metald.bmc.capabilities.Capability`` values this driver implements.
    capabilities: frozenset[str] = frozenset()

    @abc.abstractmethod
    async def identify(self) -> SystemIdentity:
        """Connect and log in (proving address and credentials), and say what system it manages."""

    async def close(self) -> None:  # noqa: B027 - optional: drivers without sessions need none
        """Release sessions and sockets. Safe to call twice."""


@dataclass(frozen=True)
class BmcEndpoint:
    """How to reach one BMC. ``__repr__`` hides the password so it cannot leak into logs."""

    address: str
    port: int | None
    username: str
    password: str = field(repr=False)
    verify_tls: bool = True
    #: PEM of a CA to trust for this BMC only (pinned), instead of the system store.
    ca_cert: str | None = field(default=None, repr=False)
