"""The network-boot step as a pure state machine: what to do next, given what just happened.

One step takes a machine (hard power-off, confirmed), makes its next boot a network one (a
one-time PXE boot, or metald's ISO in the BMC's virtual CD), arms the boot and powers it on.
``metald.provision.netboot`` runs it: it asks ``begin`` or ``advance`` for the next command,
carries it out against the store or the BMC, and feeds back what happened as an event, until
the answer is an ``Outcome``. Nothing here reads a clock, the store or a BMC, so the whole
step is a table (``TABLE``) that tests can walk.

Resumable by construction: every BMC command of a step is journaled on the BMC's row before
it is sent (``metald.bmc.ownership``), and a step always starts from that journal
(``StepLoaded``). A power-off once journaled is waited for, not sent again at once; a power-on
once journaled is sent again only when the machine reads off (powering on what is off cannot
act twice). A resumed power-off is sent once more only when the machine still reads on
``POWER_OFF_RESEND_S`` after the resume (it never reached the BMC). The watchdog resumes a
step by feeding the stored journal to ``begin``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

#: How long the step waits for a machine to read off after a hard power-off, and how often it
#: reads in the meantime.
POWER_OFF_WAIT_S = 60.0
POWER_OFF_POLL_S = 1.0
#: A step resumed from a journaled power-off whose machine still reads on this long after the
#: first read sends the power-off once more: the journal is written before the command, so an
#: instance killed between the two left an off that never reached the BMC (seen at 10,000
#: machines with an instance killed mid-wipe: the survivor waited the full minute and failed
#: the wipe). A hard power-off cannot act twice: a second one on a machine going off does
#: nothing more. Real BMCs report a hard off within seconds.
POWER_OFF_RESEND_S = 15.0

# Journal entries (``StepJournal.command``), as the BMC control records them before sending.
REQUESTED = "requested"
POWER_OFF = "power:off"
POWER_ON = "power:on"
BOOT_PXE = "boot:pxe"
VMEDIA_INSERT = "vmedia:insert"
BOOT_CD = "boot:cd"


# --- commands: what the shell does next ----------------------------------------------------


@dataclass(frozen=True)
class LoadStep:
    """Read the machine's current step and its BMC's journal (answer: ``StepLoaded``)."""


@dataclass(frozen=True)
class LoadVia:
    """Find how the machine boots: over the network, or from metald's ISO in virtual media
    (answer: ``ViaLoaded``)."""


@dataclass(frozen=True)
class CheckMediaArmed:
    """Is the machine's armed boot still the virtual-media one? (answer: ``MediaArmed``)."""


@dataclass(frozen=True)
class ReadPower:
    """Read the machine's power through the BMC after ``delay_s`` (answer: ``PowerRead``)."""

    delay_s: float = 0.0


@dataclass(frozen=True)
class PowerOff:
    """Hard power-off through the BMC, journaled before it is sent (answer: ``Sent``)."""


@dataclass(frozen=True)
class PowerOn:
    """Power on through the BMC, journaled before it is sent (answer: ``Sent``)."""


@dataclass(frozen=True)
class SetBootPxe:
    """A one-time PXE boot, in the machine's own firmware mode (answer: ``Sent``)."""


@dataclass(frozen=True)
class Arm:
    """Arm the boot in the store with its note, if the machine still boots over the network
    (answer: ``Armed``, with the boot's nonce or None)."""

    media: bool


@dataclass(frozen=True)
class InsertMedia:
    """Insert the ISO of the armed boot ``nonce`` into the BMC's virtual CD (answer: ``Sent``)."""

    nonce: str


@dataclass(frozen=True)
class BootCd:
    """A one-time boot from the virtual CD (answer: ``Sent``)."""


@dataclass(frozen=True)
class MarkDone:
    """Record the step as finished in the BMC's journal (answer: ``Sent``)."""


@dataclass(frozen=True)
class HandOver:
    """Leave the step to the BMC's owner: journal it as requested (answer: ``Sent``)."""


@dataclass(frozen=True)
class NoteNoBmc:
    """Note that the machine has no BMC to boot it through (answer: ``Sent``)."""

    detail: str


@dataclass(frozen=True)
class Fail:
    """Move the machine to its operation's failed state with ``error`` (answer: ``Sent``)."""

    error: str


Command = (
    LoadStep
    | LoadVia
    | CheckMediaArmed
    | ReadPower
    | PowerOff
    | PowerOn
    | SetBootPxe
    | Arm
    | InsertMedia
    | BootCd
    | MarkDone
    | HandOver
    | NoteNoBmc
    | Fail
)

# --- events: what happened -----------------------------------------------------------------


@dataclass(frozen=True)
class StepLoaded:
    """The stored step: ``booting`` False when the machine's state does not boot over the
    network (or the journal is of a step it has left); ``command`` the last journal entry of
    this step (None: nothing recorded); ``done`` the journal says finished."""

    booting: bool
    command: str | None = None
    done: bool = False


@dataclass(frozen=True)
class ViaLoaded:
    media: bool


@dataclass(frozen=True)
class MediaArmed:
    armed: bool


@dataclass(frozen=True)
class PowerRead:
    """The BMC's answer (``"on"``, ``"off"``, ...), read at ``now`` (monotonic seconds)."""

    state: str
    now: float


@dataclass(frozen=True)
class Sent:
    """The command was carried out, at ``now`` (monotonic seconds)."""

    now: float = 0.0


@dataclass(frozen=True)
class Armed:
    """The armed boot's nonce; None: the machine moved on meanwhile, nothing was armed."""

    nonce: str | None


@dataclass(frozen=True)
class NotOwner:
    """Another instance owns the BMC (or ownership is moving): this one sends nothing."""

    detail: str


@dataclass(frozen=True)
class NoBmc:
    """The machine has no BMC (or the BMC row is gone)."""

    detail: str


@dataclass(frozen=True)
class BmcFailed:
    """The command failed (the BMC did not answer, refused, or metald cannot serve it)."""

    detail: str


@dataclass(frozen=True)
class StoreDown:
    """The database is unreachable: the step is postponed (the watchdog resumes it)."""


@dataclass(frozen=True)
class TimedOut:
    """The machine did not read off within ``POWER_OFF_WAIT_S`` of the power-off."""


Event = (
    StepLoaded
    | ViaLoaded
    | MediaArmed
    | PowerRead
    | Sent
    | Armed
    | NotOwner
    | NoBmc
    | BmcFailed
    | StoreDown
    | TimedOut
)

# --- outcomes ----------------------------------------------------------------------------


class Outcome(StrEnum):
    """How a step ended. Only ``DONE`` means the machine is booting."""

    DONE = "done"
    NOT_BOOTING = "not-booting"  # its state does not boot over the network (any more)
    MOVED_ON = "moved-on"  # it left the state before the boot was armed
    LEFT_TO_OWNER = "left-to-owner"  # another instance owns the BMC: journaled as requested
    NO_BMC = "no-bmc"
    FAILED = "failed"  # moved to the failed state with the BMC's error
    POSTPONED = "postponed"  # the store is down: resumed by the watchdog

    @property
    def ok(self) -> bool:
        return self is Outcome.DONE


# --- the machine -------------------------------------------------------------------------


class Phase(StrEnum):
    """Which command the step is waiting on."""

    LOAD_STEP = "load-step"
    LOAD_VIA = "load-via"
    CHECK_MEDIA = "check-media"
    CHECK_OFF = "check-off"  # the power read before a power-off
    POWERING_OFF = "powering-off"
    WAIT_OFF = "wait-off"
    ARM_MEDIA = "arm-media"
    INSERT = "insert"
    BOOT_CD = "boot-cd"
    SET_PXE = "set-pxe"
    ARM_PXE = "arm-pxe"
    POWERING_ON = "powering-on"
    CHECK_ON = "check-on"  # the power read after a journaled power-on
    MARK_DONE = "mark-done"
    # the ends of a step that did not boot: their own failures end the step all the same
    HANDING_OVER = "handing-over"
    NOTING = "noting"
    FAILING = "failing"
    CLOSING = "closing"  # after FAILING: the failed step's journal is closed


@dataclass(frozen=True)
class Step:
    """Where one step is: its phase, what its journal shows sent, how it boots."""

    phase: Phase = Phase.LOAD_STEP
    #: The journal's last command of this step, as this run knows it.
    sent: str | None = None
    media: bool = False
    #: When the wait for the machine to read off began (monotonic seconds).
    off_since: float | None = None
    #: The power-off being waited for was journaled by an earlier run (a restart, another
    #: instance): it may never have been sent (``POWER_OFF_RESEND_S``).
    resumed_off: bool = False


Decision = tuple[Step, Command | Outcome]
#: One rule of the table: the step and the event (of the type the table keys it by).
Rule = Callable[[Step, Any], Decision]


def start() -> Decision:
    """A step run from the beginning: it reads the stored step first."""
    return Step(), LoadStep()


def begin(stored: StepLoaded) -> Decision:
    """A step resumed from what the store holds of it (the watchdog's entry)."""
    return advance(Step(), stored)


def advance(step: Step, event: Event) -> Decision:
    """The next command (or the outcome) after ``event`` in ``step``."""
    rule = TABLE.get((step.phase, type(event)))
    if rule is None:
        rule = _ON_FAILURE.get(type(event))
    if rule is None:
        raise ValueError(f"network-boot step: no rule for {type(event).__name__} in {step.phase}")
    return rule(step, event)


def resumes(stored: StepLoaded) -> bool:
    """Whether a stored step is resumed (the watchdog's question): anything but an outcome."""
    return not isinstance(begin(stored)[1], Outcome)


# --- rules -------------------------------------------------------------------------------


def _loaded(step: Step, e: StepLoaded) -> Decision:
    if not e.booting:
        return step, Outcome.NOT_BOOTING
    if e.done:
        return step, Outcome.DONE
    return replace(step, phase=Phase.LOAD_VIA, sent=e.command), LoadVia()


def _via(step: Step, e: ViaLoaded) -> Decision:
    step = replace(step, media=e.media)
    if e.media and step.sent == BOOT_CD:
        return replace(step, phase=Phase.CHECK_MEDIA), CheckMediaArmed()
    return _from_journal(step)


def _media_armed(step: Step, e: MediaArmed) -> Decision:
    if not e.armed:  # the inserted ISO's boot is gone (taken or re-armed): insert again
        return _after_off(replace(step, sent=POWER_OFF))
    return _after_off(step)


def _from_journal(step: Step) -> Decision:
    if step.sent in (None, REQUESTED):
        return replace(step, phase=Phase.CHECK_OFF), ReadPower()
    if step.sent == POWER_OFF:  # journaled before a restart or failover: wait for it first
        return replace(step, phase=Phase.WAIT_OFF, resumed_off=True), ReadPower()
    return _after_off(step)


def _after_off(step: Step) -> Decision:
    """The commands after the machine is off, from the last one the journal shows."""
    sent = step.sent
    if step.media and sent in (POWER_OFF, VMEDIA_INSERT):
        # Armed first, with a nonce of its own: the ISO (built per boot) carries its URL, the
        # only way to this boot's token. Inserting again after a failover is harmless.
        return replace(step, phase=Phase.ARM_MEDIA), Arm(media=True)
    # A boot device journaled may not have reached the BMC (the journal is written before the
    # command is sent): it is set again, which cannot act twice (a one-time override).
    if sent == BOOT_CD and step.media:
        return replace(step, phase=Phase.BOOT_CD), BootCd()
    if sent == BOOT_CD:
        return replace(step, phase=Phase.POWERING_ON), PowerOn()
    if sent in (POWER_OFF, BOOT_PXE):
        return replace(step, phase=Phase.SET_PXE), SetBootPxe()
    if sent == POWER_ON:  # sent before a restart: read whether it reached the BMC
        return replace(step, phase=Phase.CHECK_ON), ReadPower()
    return replace(step, phase=Phase.MARK_DONE), MarkDone()


def _off_read(step: Step, e: PowerRead) -> Decision:
    if e.state == "off":
        return _after_off(replace(step, sent=POWER_OFF))
    return replace(step, phase=Phase.POWERING_OFF), PowerOff()


def _off_sent(step: Step, e: Sent) -> Decision:
    return replace(step, phase=Phase.WAIT_OFF, sent=POWER_OFF, off_since=e.now), ReadPower()


def _wait_read(step: Step, e: PowerRead) -> Decision:
    if e.state == "off":
        return _after_off(replace(step, sent=POWER_OFF))
    since = e.now if step.off_since is None else step.off_since
    step = replace(step, off_since=since)  # resumed: the wait starts with its first read
    if step.resumed_off and e.now - since > POWER_OFF_RESEND_S:
        # Still on: the journaled power-off never reached the BMC. Sent now, once.
        return replace(step, phase=Phase.POWERING_OFF, resumed_off=False), PowerOff()
    if e.now - since > POWER_OFF_WAIT_S:
        return advance(step, TimedOut())
    return step, ReadPower(delay_s=POWER_OFF_POLL_S)


def _timed_out(step: Step, e: TimedOut) -> Decision:
    return _fail(
        step,
        f"the BMC did not report the machine off within {POWER_OFF_WAIT_S:.0f} s of a "
        "power-off; check the BMC and retry",
    )


def _armed(step: Step, e: Armed) -> Decision:
    if e.nonce is None:
        return step, Outcome.MOVED_ON
    if step.phase is Phase.ARM_MEDIA:
        return replace(step, phase=Phase.INSERT, sent=VMEDIA_INSERT), InsertMedia(e.nonce)
    return replace(step, phase=Phase.POWERING_ON), PowerOn()


def _on_read(step: Step, e: PowerRead) -> Decision:
    if e.state == "on":  # it reached the BMC: the machine is booting
        return replace(step, phase=Phase.MARK_DONE), MarkDone()
    return replace(step, phase=Phase.POWERING_ON), PowerOn()


def _then(phase: Phase, sent: str | None, command: Command) -> Rule:
    def rule(step: Step, e: Event) -> Decision:
        return replace(step, phase=phase, sent=sent or step.sent), command

    return rule


def _end(outcome: Outcome) -> Rule:
    return lambda step, e: (step, outcome)


def _fail(step: Step, detail: str) -> Decision:
    return replace(step, phase=Phase.FAILING), Fail(f"BMC: {detail}")


def _not_owner(step: Step, e: NotOwner) -> Decision:
    if step.phase is Phase.LOAD_STEP:
        return step, Outcome.LEFT_TO_OWNER
    return replace(step, phase=Phase.HANDING_OVER), HandOver()


def _no_bmc(step: Step, e: NoBmc) -> Decision:
    return replace(step, phase=Phase.NOTING), NoteNoBmc(e.detail)


def _bmc_failed(step: Step, e: BmcFailed) -> Decision:
    return _fail(step, e.detail)


#: (phase, event) -> the rule that gives the next command or the outcome.
TABLE: dict[tuple[Phase, type], Rule] = {
    (Phase.LOAD_STEP, StepLoaded): _loaded,
    (Phase.LOAD_VIA, ViaLoaded): _via,
    (Phase.CHECK_MEDIA, MediaArmed): _media_armed,
    (Phase.CHECK_OFF, PowerRead): _off_read,
    (Phase.POWERING_OFF, Sent): _off_sent,
    (Phase.WAIT_OFF, PowerRead): _wait_read,
    (Phase.WAIT_OFF, TimedOut): _timed_out,
    (Phase.ARM_MEDIA, Armed): _armed,
    (Phase.INSERT, Sent): _then(Phase.BOOT_CD, BOOT_CD, BootCd()),
    (Phase.BOOT_CD, Sent): _then(Phase.POWERING_ON, BOOT_CD, PowerOn()),
    (Phase.SET_PXE, Sent): _then(Phase.ARM_PXE, BOOT_PXE, Arm(media=False)),
    (Phase.ARM_PXE, Armed): _armed,
    (Phase.POWERING_ON, Sent): _then(Phase.MARK_DONE, POWER_ON, MarkDone()),
    (Phase.CHECK_ON, PowerRead): _on_read,
    (Phase.MARK_DONE, Sent): _end(Outcome.DONE),
    # the ends of a step that does not boot
    (Phase.HANDING_OVER, Sent): _end(Outcome.LEFT_TO_OWNER),
    (Phase.NOTING, Sent): _end(Outcome.NO_BMC),
    (Phase.FAILING, Sent): _then(Phase.CLOSING, None, MarkDone()),
    (Phase.CLOSING, Sent): _end(Outcome.FAILED),
}
# Their own failures end them all the same (the store or the BMC went away meanwhile).
for _phase, _outcome in (
    (Phase.HANDING_OVER, Outcome.LEFT_TO_OWNER),
    (Phase.NOTING, Outcome.NO_BMC),
    (Phase.FAILING, Outcome.FAILED),
    (Phase.CLOSING, Outcome.FAILED),
):
    for _event in (NotOwner, NoBmc, BmcFailed, StoreDown):
        TABLE[(_phase, _event)] = _end(_outcome)
# ... except a failed state the store could not record: the step is postponed, not failed.
TABLE[(Phase.FAILING, StoreDown)] = _end(Outcome.POSTPONED)

#: What a failure does in any phase that has no rule of its own for it.
_ON_FAILURE: dict[type, Rule] = {
    NotOwner: _not_owner,
    NoBmc: _no_bmc,
    BmcFailed: _bmc_failed,
    StoreDown: _end(Outcome.POSTPONED),
}
