"""One firmware update's steps, as a table: (phase, what happened) -> (next phase, what to do).

Pure: no store, no BMC, no clock. ``metald.firmware.service`` records the phase in the store
before it does what the table says, so an update cut off anywhere (a crash, a ``kill -9``, a
failover to another instance) is resumed from its recorded phase with ``Event.RESUME``:

- the offer (SimpleUpdate or push) is recorded as ``offering`` *before* it is sent; resumed
  there, metald looks for the BMC's task by the update's id (it rides in the request) and
  never offers again: a BMC that has no such task is a failure for a person to look at, not
  a second flash;
- the host is power-cycled (or the BMC reset) only after the BMC's task says the flash
  completed, never while it runs: the service keeps power commands off the BMC meanwhile;
- ``done`` only once the version read back from the BMC is the wanted one.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Phase(StrEnum):
    QUEUED = "queued"
    #: The offer is recorded as sent (it may or may not have reached the BMC).
    OFFERING = "offering"
    #: The BMC accepted it; its task runs.
    FLASHING = "flashing"
    #: The task completed; the host is being power-cycled (or the BMC reset).
    APPLYING = "applying"
    #: Reading the version back until it is the wanted one.
    VERIFYING = "verifying"
    DONE = "done"
    FAILED = "failed"


#: The phases in which the BMC may be writing firmware: no power command reaches the host.
FLASH_WINDOW = frozenset({Phase.OFFERING, Phase.FLASHING})
FINAL = frozenset({Phase.DONE, Phase.FAILED})
OPEN = frozenset(Phase) - FINAL


class Event(StrEnum):
    START = "start"
    #: The service picked the update up again (after a restart or a failover).
    RESUME = "resume"
    #: The BMC accepted the offer and named its task.
    OFFERED = "offered"
    #: The BMC refused the offer (its answer is the reason).
    REFUSED = "refused"
    #: Resumed in ``offering``: the BMC's task for this update was found / not found.
    TASK_FOUND = "task-found"
    TASK_MISSING = "task-missing"
    #: The task is still running (progress), ended well, ended badly, or vanished.
    TASK_RUNNING = "task-running"
    TASK_COMPLETED = "task-completed"
    TASK_FAILED = "task-failed"
    TASK_GONE = "task-gone"
    #: The apply step (host power cycle or BMC reset) was done.
    APPLIED = "applied"
    #: The version read back is / is not the wanted one.
    VERSION_OK = "version-ok"
    VERSION_OTHER = "version-other"
    #: The phase's deadline passed.
    TIMEOUT = "timeout"


class Action(StrEnum):
    #: Verify the image, record ``offering``, then send SimpleUpdate or the multipart push.
    OFFER = "offer"
    FIND_TASK = "find-task"
    POLL_TASK = "poll-task"
    #: Power-cycle the host / reset the BMC (the component's ``apply``).
    APPLY = "apply"
    READ_VERSION = "read-version"
    #: Nothing more: the update ended (done or failed).
    STOP = "stop"


@dataclass(frozen=True)
class Decision:
    phase: Phase
    action: Action
    #: Why it failed, for the record (only with ``Phase.FAILED``).
    reason: str | None = None


class IllegalEvent(ValueError):
    """An event the update's phase does not take (a bug in the caller, never the BMC's)."""


_E, _P, _A = Event, Phase, Action

#: (phase, event) -> (phase, action, reason when failed).
TABLE: dict[tuple[Phase, Event], tuple[Phase, Action, str | None]] = {
    # OFFER verifies the image, records ``offering``, and only then sends.
    (_P.QUEUED, _E.START): (_P.QUEUED, _A.OFFER, None),
    (_P.QUEUED, _E.RESUME): (_P.QUEUED, _A.OFFER, None),
    (_P.QUEUED, _E.REFUSED): (_P.FAILED, _A.STOP, "the update could not be offered"),
    (_P.OFFERING, _E.OFFERED): (_P.FLASHING, _A.POLL_TASK, None),
    (_P.OFFERING, _E.REFUSED): (_P.FAILED, _A.STOP, "the BMC refused the update"),
    # Cut off after the offer was recorded: it may have reached the BMC. Look, never resend.
    (_P.OFFERING, _E.RESUME): (_P.OFFERING, _A.FIND_TASK, None),
    (_P.OFFERING, _E.TASK_FOUND): (_P.FLASHING, _A.POLL_TASK, None),
    (_P.OFFERING, _E.TASK_MISSING): (
        _P.FAILED,
        _A.STOP,
        "metald was cut off while offering the image and the BMC has no task for it; it was "
        "not offered again (an update is never sent twice): check the BMC and start the "
        "update again",
    ),
    (_P.FLASHING, _E.RESUME): (_P.FLASHING, _A.POLL_TASK, None),
    (_P.FLASHING, _E.TASK_RUNNING): (_P.FLASHING, _A.POLL_TASK, None),
    (_P.FLASHING, _E.TASK_FAILED): (_P.FAILED, _A.STOP, "the BMC's update task failed"),
    (_P.FLASHING, _E.TASK_GONE): (
        _P.FAILED,
        _A.STOP,
        "the BMC's update task disappeared before it finished; check the BMC's firmware "
        "inventory before updating again",
    ),
    (_P.FLASHING, _E.TIMEOUT): (
        _P.FAILED,
        _A.STOP,
        "the BMC's update task did not finish in time; check the BMC before powering the host",
    ),
    # Flashed and needs nothing: read back. Needs a reset: apply first (never before this).
    (_P.APPLYING, _E.RESUME): (_P.APPLYING, _A.APPLY, None),
    (_P.APPLYING, _E.APPLIED): (_P.VERIFYING, _A.READ_VERSION, None),
    (_P.APPLYING, _E.TIMEOUT): (_P.FAILED, _A.STOP, "the apply step did not finish in time"),
    (_P.VERIFYING, _E.RESUME): (_P.VERIFYING, _A.READ_VERSION, None),
    (_P.VERIFYING, _E.VERSION_OK): (_P.DONE, _A.STOP, None),
    (_P.VERIFYING, _E.VERSION_OTHER): (_P.VERIFYING, _A.READ_VERSION, None),
    (_P.VERIFYING, _E.TIMEOUT): (
        _P.FAILED,
        _A.STOP,
        "the BMC still reports another version after the update",
    ),
}
for _phase in (_P.QUEUED, _P.OFFERING):
    TABLE[(_phase, _E.TIMEOUT)] = (_P.FAILED, _A.STOP, "the BMC did not take the update in time")


def decide(phase: Phase, event: Event, *, apply: str = "none", detail: str = "") -> Decision:
    """The next phase and action; ``apply`` is the component's (none, host-reset, bmc-reset)
    and ``detail`` (the BMC's words) is added to a failure's reason."""
    if (phase, event) == (Phase.FLASHING, Event.TASK_COMPLETED):
        if apply == "none":
            return Decision(Phase.VERIFYING, Action.READ_VERSION)
        return Decision(Phase.APPLYING, Action.APPLY)
    try:
        nxt, action, reason = TABLE[(phase, event)]
    except KeyError:
        raise IllegalEvent(
            f"an update in phase {phase.value} does not take {event.value}"
        ) from None
    if reason is not None and detail:
        reason = f"{reason}: {detail}"
    return Decision(nxt, action, reason)


def power_allowed(phase: Phase) -> bool:
    """Whether a power command may reach the host while an update is in this phase."""
    return phase not in FLASH_WINDOW
