"""BMC control as the rest of metald sees it: the typed interface and its errors.

``PowerControl`` is the narrow interface the provisioning code calls (``PowerAction`` in,
``PowerState`` out; no dicts, no strings). ``metald.bmc.executor.BmcExecutor`` implements it over
the drivers and the scheduler; this module names no protocol, so callers reach none.
``Executor`` is what the capability modules (``chassis``, ``firmware``, ``media``) send their
commands through: one public, fenced ``execute``.

With several instances (metald.fleet) a command is sent only by the BMC's owner, and only after
the store confirmed, in the same statement that journals it, that this instance still holds
the BMC at the generation it acquired (``metald.bmc.ownership``): an instance that lost the BMC
(judged dead, superseded) cannot send anything, and a fenced one does not even ask.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from metald.bmc.base import BootTarget, PowerAction, PowerState
from metald.bmc.capabilities import Capability
from metald.config import BmcConfig
from metald.errors import MetaldError, NotFound
from metald.store.db import Store
from metald.store.models import Bmc, Machine, as_utc

if TYPE_CHECKING:
    from metald.bmc.power_confirm import CommandBook

T = TypeVar("T")


class BmcCommandFailed(MetaldError):
    """The BMC did not do what was asked (unreachable, refused, errored). Maps to 502."""

    status = 502
    title = "BMC command failed"


class NoBmc(NotFound):
    """The machine has no BMC linked."""


class NotOwner(MetaldError):
    """Another instance owns this BMC (or ownership is moving): this one sends nothing."""

    status = 503
    title = "BMC owned by another instance"

    def __init__(self, detail: str, owner: str | None = None, **extra: Any) -> None:
        super().__init__(detail, owner_instance=owner, **extra)
        self.owner = owner


class PowerControl(Protocol):
    """What provisioning asks of a machine's BMC. Raises ``NoBmc`` when the machine has none,
    ``NotOwner`` when another instance must send it, ``MetaldError`` when the BMC failed.

    ``step`` names the provisioning step a command belongs to (``step_key``): the command is
    journaled in the store before it is sent, so an instance taking the BMC over can tell
    what was already sent and never sends it blindly again.
    """

    async def power(
        self, machine_id: str, action: PowerAction, *, actor: str = ..., step: str | None = ...
    ) -> PowerState: ...

    async def read_power(self, machine_id: str, *, actor: str = ...) -> PowerState:
        """Ask the BMC now (not a cached value)."""

    async def set_boot_device(
        self,
        machine_id: str,
        device: BootTarget,
        persistent: bool = ...,
        *,
        uefi: bool | None = ...,
        actor: str = ...,
        step: str | None = ...,
    ) -> None: ...


class BmcOwnership(Protocol):
    """Which instance owns a BMC (metald.fleet.membership.Membership)."""

    instance: str
    dead_after_s: float
    #: Changes when the lease lapsed before it was renewed (see ``lease_until``).
    lease_epoch: int

    @property
    def fenced(self) -> bool: ...

    def lease_until(self) -> float: ...

    def bmc_owner(self, bmc_id: str, address: str) -> str | None: ...

    def owns_bmc(self, bmc_id: str, address: str) -> bool: ...


@dataclass(frozen=True)
class Expected:
    """The power state metald asked for, and until when a different reading is not drift."""

    state: PowerState
    until: float


class Executor(Protocol):
    """The fenced executor (``metald.bmc.executor.BmcExecutor``) as commands use it."""

    store: Store
    cfg: BmcConfig
    instance: str
    #: bmc id -> what metald asked for (see power sync's drift check).
    expected: dict[str, Expected]
    #: Power commands this instance sent, by id.
    commands: CommandBook

    async def execute(
        self,
        row: Bmc,
        capability: Capability,
        name: str,
        fn: Callable[[Any], Awaitable[T]],
        *,
        write: bool = ...,
        journal: str | None = ...,
        step: str | None = ...,
        before_send: Callable[[], None] | None = ...,
        idempotent: bool = ...,
        timeout_s: float | None = ...,
    ) -> T:
        """One command, fenced, journaled, scheduled (see ``BmcExecutor.execute``)."""

    async def run(self, row: Bmc, op_name: str, fn: Callable[[Any], Awaitable[T]]) -> T:
        """Under the scheduler within the lease, unfenced: reads that confirm a sent command."""

    def require(self, row: Bmc, capability: Capability, hint: str = ...) -> None: ...

    async def row_for_machine(self, machine_id: str) -> Bmc: ...

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> Any: ...


def step_key(m: Machine) -> str:
    """One entry of a machine into a state: what a provisioning step's journal is keyed by."""
    return step_key_of(m.state, m.state_changed_at)


def step_key_of(state: str, state_changed_at: datetime) -> str:
    """``step_key`` from the two columns it is made of (for scans that read only those)."""
    return f"{state}@{as_utc(state_changed_at).isoformat()}"
