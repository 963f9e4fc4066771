"""Confirmed power: a power command is done when the BMC reports the state it asked for.

A BMC accepts a reset and applies it later (sushy-emulator: 1-11 s; real BMCs: seconds, or
never when a PSU is out). ``PowerCommand`` is one sent command and what the BMC said since;
``poll_delays`` is the backoff the confirmation reads with. The polling itself is
``metald.bmc.chassis`` (it reads through the scheduler, like every other command).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from metald.bmc.base import PowerAction, PowerState
from metald.store.models import new_id


class CommandStatus(StrEnum):
    PENDING = "pending"  # sent; the BMC has not reported the target state yet
    CONFIRMED = "confirmed"  # the BMC reported the target state
    FAILED = "failed"  # the BMC never reported it within power_state_give_up_s


def target_of(action: PowerAction) -> PowerState:
    """The state an action ends in: what its confirmation waits for (a cycle or reset ends on)."""
    return PowerState.OFF if action in (PowerAction.OFF, PowerAction.SOFT_OFF) else PowerState.ON


def poll_delays(first_s: float = 0.25, cap_s: float = 4.0) -> Iterator[float]:
    """Seconds before each read after the first: doubling from ``first_s`` up to ``cap_s``
    (60 s of waiting costs about 20 reads, not 240)."""
    d = first_s
    while True:
        yield d
        d = min(cap_s, d * 2)


async def wait_for_state(
    read: Callable[[], Awaitable[PowerState]],
    target: PowerState,
    give_up_at: float,
    on_reading: Callable[[PowerState], Awaitable[None]] | None = None,
    on_error: Callable[[Exception], None] | None = None,
    errors: tuple[type[Exception], ...] = (),
) -> CommandStatus:
    """Read (backing off, ``poll_delays``) until ``read`` reports ``target`` (CONFIRMED) or
    the monotonic clock passes ``give_up_at`` (FAILED). A read failing with one of ``errors``
    is reported to ``on_error`` and read again later."""
    delays = poll_delays()
    while True:
        try:
            state = await read()
        except errors as e:
            if on_error is not None:
                on_error(e)
        else:
            if on_reading is not None:
                await on_reading(state)
            if state is target:
                return CommandStatus.CONFIRMED
        left = give_up_at - time.monotonic()
        if left <= 0:
            return CommandStatus.FAILED
        await asyncio.sleep(min(next(delays), left))


@dataclass
class PowerCommand:
    bmc_id: str
    machine_id: str | None
    action: PowerAction
    target: PowerState
    id: str = field(default_factory=new_id)
    status: CommandStatus = CommandStatus.PENDING
    #: The last state the BMC reported since the command was sent (None: no reading yet).
    observed: PowerState | None = None
    #: Why the last read failed, when it did (the BMC's words, never credentials).
    last_error: str | None = None
    sent_at: float = field(default_factory=time.monotonic)
    done_at: float | None = None
    #: The request that sent it already answered 202: the outcome is reported as an event.
    answered: bool = False

    @property
    def elapsed_s(self) -> float:
        return round((self.done_at or time.monotonic()) - self.sent_at, 3)

    def public(self) -> dict[str, Any]:
        return {
            "command_id": self.id,
            "bmc_id": self.bmc_id,
            "machine_id": self.machine_id,
            "action": self.action.value,
            "target_state": self.target.value,
            "status": self.status.value,
            "power_state": self.observed.value if self.observed else None,
            "elapsed_s": self.elapsed_s,
            "detail": self.last_error,
        }


class CommandBook:
    """Recent power commands by id, bounded: pending ones are always kept, the oldest finished
    ones are dropped first (their outcome stays in the event log)."""

    def __init__(self, keep: int = 10_000) -> None:
        self.keep = keep
        self._by_id: OrderedDict[str, PowerCommand] = OrderedDict()

    def add(self, cmd: PowerCommand) -> None:
        self._by_id[cmd.id] = cmd
        if len(self._by_id) > self.keep:
            for cid in [
                c.id for c in self._by_id.values() if c.status is not CommandStatus.PENDING
            ]:
                if len(self._by_id) <= self.keep:
                    break
                del self._by_id[cid]

    def get(self, command_id: str) -> PowerCommand | None:
        return self._by_id.get(command_id)
