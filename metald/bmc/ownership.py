"""Who holds a BMC, in the store: owner, fencing generation, and the journal of the current
provisioning step. Store functions (run them with ``Store.run``).

The rendezvous hash (metald.fleet) says which live instance *should* own a BMC; the row says
which one *does*. An instance acquires a BMC only when the row's owner is nobody, itself, or an
instance that is not alive (by the database's clock), and every acquisition raises the
generation. A command is sent only after ``check_and_journal`` found the row still held by the
sender at the generation it acquired, so a superseded owner can never send one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import and_, exists, or_, select, update
from sqlmodel import Session

from metald.errors import Conflict
from metald.fleet.registry import db_now
from metald.store.models import Bmc, FirmwareUpdate, Instance

#: Firmware update phases in which the BMC may be writing firmware (metald.firmware.updates'
#: FLASH_WINDOW): no power command reaches the host then.
FLASHING_PHASES = ("offering", "flashing")


class FlashInProgress(Conflict):
    title = "Firmware is being flashed"


@dataclass(frozen=True)
class BmcRef:
    id: str
    address: str
    owner: str | None
    generation: int


def rows(s: Session) -> list[BmcRef]:
    got = s.execute(select(Bmc.id, Bmc.address, Bmc.owner, Bmc.generation)).all()  # type: ignore[call-overload]
    return [BmcRef(*r) for r in got]


def _live_names(s: Session, dead_after_s: float) -> list[str]:
    cutoff = db_now(s) - timedelta(seconds=dead_after_s)
    return list(
        s.execute(
            select(Instance.name).where(
                Instance.stopped_at.is_(None),  # type: ignore[union-attr]
                Instance.heartbeat_at >= cutoff,  # type: ignore[arg-type, operator]
            )
        ).scalars()
    )


def acquire(
    s: Session,
    me: str,
    bmc_ids: list[str],
    dead_after_s: float,
    *,
    release_others: bool = False,
) -> dict[str, int]:
    """Take each BMC of ``bmc_ids`` that nobody alive holds (generation + 1); with
    ``release_others``, give up every other BMC this instance holds. Returns what this
    instance holds now among ``bmc_ids``: bmc id -> generation."""
    live = [n for n in _live_names(s, dead_after_s) if n != me]
    free = or_(Bmc.owner.is_(None), Bmc.owner.not_in(live))  # type: ignore[union-attr]
    if release_others:
        s.execute(
            update(Bmc)
            .where(Bmc.owner == me, Bmc.id.not_in(bmc_ids))  # type: ignore[arg-type, union-attr]
            .values(owner=None)
        )
    for i in range(0, len(bmc_ids), 500):
        chunk = bmc_ids[i : i + 500]
        s.execute(
            update(Bmc)
            .where(and_(Bmc.id.in_(chunk), or_(Bmc.owner.is_(None), Bmc.owner != me), free))  # type: ignore[union-attr]
            .values(owner=me, generation=Bmc.generation + 1)
        )
    held: dict[str, int] = {}
    for i in range(0, len(bmc_ids), 500):
        chunk = bmc_ids[i : i + 500]
        for bid, gen in s.execute(
            select(Bmc.id, Bmc.generation).where(Bmc.owner == me, Bmc.id.in_(chunk))  # type: ignore[call-overload, union-attr]
        ).all():
            held[bid] = gen
    s.commit()
    return held


def check_and_journal(
    s: Session,
    bmc_id: str,
    me: str | None,
    generation: int | None,
    step: str | None,
    command: str | None,
) -> bool:
    """In one statement: is the BMC still held by ``me`` at ``generation`` (no check without a
    fleet), and, for a provisioning step's command, record it as sent. False: do not send."""
    cond = [Bmc.id == bmc_id]
    if generation is not None:
        cond += [Bmc.owner == me, Bmc.generation == generation]
    flashing = exists().where(
        FirmwareUpdate.bmc_id == bmc_id,
        FirmwareUpdate.phase.in_(FLASHING_PHASES),  # type: ignore[attr-defined]
    )
    power = command is not None and command.startswith("power:")
    if power:
        # Never power the host off (or cycle it) while its BMC may be writing firmware.
        cond.append(~flashing)
    values: dict[str, object] = (
        {"step": step, "step_command": command, "step_done": False}
        if step is not None
        else {"generation": Bmc.generation}  # a no-op write: the check alone
    )
    res = s.execute(update(Bmc).where(*cond).values(**values))  # type: ignore[arg-type]
    s.commit()
    if res.rowcount != 1 and power and s.execute(select(flashing)).scalar():  # type: ignore[attr-defined]
        raise FlashInProgress(
            f"BMC {bmc_id} is flashing firmware: power commands to its host are refused until "
            "the update's task ends (GET /api/v1/machines/{id}/firmware/updates)",
            bmc_id=bmc_id,
        )
    return res.rowcount == 1  # type: ignore[attr-defined]


@dataclass(frozen=True)
class StepJournal:
    """What the BMC's journal says about one provisioning step."""

    bmc_id: str
    #: The last command recorded as sent in this step ("power:off", "boot:pxe", "power:on"),
    #: "requested" (an instance that does not own the BMC asked its owner to run the step), or
    #: None (nothing recorded for this step).
    command: str | None
    done: bool


def read_step(s: Session, machine_id: str, step: str) -> StepJournal | None:
    """The journal of ``step`` for the machine's BMC; None when the machine has no BMC."""
    row = s.execute(select(Bmc).where(Bmc.machine_id == machine_id)).scalar_one_or_none()  # type: ignore[arg-type]
    if row is None:
        return None
    if row.step != step:
        return StepJournal(row.id, None, False)
    return StepJournal(row.id, row.step_command, row.step_done)


def mark_step(s: Session, machine_id: str, step: str, *, command: str | None, done: bool) -> None:
    """Record a step's progress that is no BMC command: requested, or finished."""
    values: dict[str, object] = {"step": step, "step_done": done}
    if command is not None:
        values["step_command"] = command
    cond = [Bmc.machine_id == machine_id]
    if command == "requested":  # never over the journal of a step already under way
        cond.append(or_(Bmc.step.is_(None), Bmc.step != step))  # type: ignore[union-attr]
    s.execute(update(Bmc).where(*cond).values(**values))  # type: ignore[arg-type]
    s.commit()


def unfinished_steps(s: Session) -> list[tuple[str, str, str, str]]:
    """(machine id, bmc id, bmc address, step) of every BMC whose journal holds a step not
    finished; the caller keeps those it owns (it acquires them before its first command)."""
    q = select(Bmc.machine_id, Bmc.id, Bmc.address, Bmc.step).where(  # type: ignore[call-overload]
        Bmc.step.is_not(None),  # type: ignore[union-attr]
        Bmc.step_done.is_(False),  # type: ignore[attr-defined]
        Bmc.machine_id.is_not(None),  # type: ignore[union-attr]
    )
    return [(m, b, a, st) for m, b, a, st in s.execute(q).all()]
