"""Commissioning runs in the store: start one when an inventory arrives and a profile applies,
record each check's result (metald's verdict, recomputed), finish the run with the machine's
transition, and read the last run and history.

Every function takes an open ``Session``; ``record_results`` commits results, events and the
final transition in one transaction.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, bindparam, exists
from sqlmodel import Session, col, select

from metald import machines, repairs
from metald.commissioning.checks import RAW_LIMIT, CheckReport, judge_check, summarise
from metald.commissioning.parsers import bmc_sel
from metald.commissioning.profile import (
    METALD_CHECKS,
    SKU_CHECK,
    CommissioningProfile,
    compare_sku,
)
from metald.commissioning.verdict import Status, Verdict
from metald.errors import Conflict, MetaldError, Unprocessable
from metald.inventory.normalize import NormalizedInventory
from metald.inventory.rules import profile_for
from metald.lifecycle import COMMISSION_REQUESTABLE, COMMISSION_RUNNING, State, Trigger
from metald.service import TaskScope
from metald.store.models import CommissioningResult, CommissioningRun, Machine, as_utc, utcnow

log = logging.getLogger(__name__)

REQUESTED, RUNNING = "requested", "running"
SEL_CHECK = "bmc-sel"
#: Run statuses that end it.
FINAL = frozenset({Status.PASSED.value, Status.FAILED.value, Status.ERROR.value})


def _open_run(s: Session, machine_id: str, status: str) -> CommissioningRun | None:
    # Found through ix_commissioning_runs_machine_status (machine and status). With the status
    # index alone SQLite's planner (no statistics) read every running run for each agent
    # request of a storm: quadratic in the machines commissioning at once.
    # One statement built once: building and keying a new one per call was most of its cost,
    # and every accepted inventory of a storm asks it.
    return s.exec(_OPEN_RUN, params={"m": machine_id, "status": status}).first()


_OPEN_RUN = (
    select(CommissioningRun)
    .where(
        CommissioningRun.machine_id == bindparam("m"),
        CommissioningRun.status == bindparam("status"),
    )
    .order_by(col(CommissioningRun.created_at).desc())
)


def request_run(
    s: Session,
    machine_id: str,
    *,
    profile: CommissioningProfile | None,
    actor: str,
    reason: str | None,
    instance: str | None = None,
) -> CommissioningRun:
    """A technician's commissioning (on demand, or again after a repair): the machine is
    inspected again (its discovery boot is armed and the runner network-boots it) and the run
    starts when that boot's inventory is accepted. ``profile`` is what the enroll rules give
    the machine's current inventory; none is refused."""
    m = machines.get_machine(s, machine_id)
    if State(m.state) not in COMMISSION_REQUESTABLE:
        allowed = ", ".join(sorted(x.value for x in COMMISSION_REQUESTABLE))
        raise Conflict(
            f"cannot commission a machine that is {m.state}; commissioning starts only from: "
            f"{allowed}"
        )
    if profile is None:
        raise Unprocessable(
            f"no enroll rule gives machine {machine_id} a commissioning profile; add a "
            "[enroll.rules.commissioning] profile whose rule matches it, then retry"
        )
    run = CommissioningRun(
        machine_id=machine_id,
        profile=profile.name,
        status=REQUESTED,
        spec=profile.model_dump(),
        requested_by=actor,
    )
    s.add(run)
    machines.transition(
        s,
        machine_id,
        Trigger.INSPECT,
        actor=actor,
        reason=reason or f"commissioning requested (profile {profile.name})",
        data={"commissioning_run": run.id},
        updates={"boot_intent": {"action": "inspect"}},
        instance=instance,
        commit=False,
        machine=m,
    )
    s.commit()
    return run


def after_wipe(
    s: Session, m: Machine, rules: list[Any], *, actor: str, instance: str | None = None
) -> bool:
    """In the wipe's transaction, just after ``wiped``: a profile that asks ``on_release``
    sends the machine back through inspection and commissioning before any claim sees it
    ready. Returns whether it did (the caller then network-boots the machine)."""
    doc = (m.inventory or {}).get("normalized")
    if doc is None:
        return False
    profile = profile_for(rules, NormalizedInventory.model_validate(doc), m.rack_position)
    repaired = repairs.verifying(s, m.id) is not None
    if profile is None or not (profile.on_release or repaired):
        return False
    why = (
        "commissioning after repair (the wipe came first)"
        if repaired
        else f"commissioning again after release (profile {profile.name} asks on_release)"
    )
    request_run(s, m.id, profile=profile, actor=actor, reason=why, instance=instance)
    return True


def trigger_after_inventory(
    s: Session, machine_id: str, profile: CommissioningProfile | None
) -> Trigger:
    """``commission`` when a profile applies to the inventory just accepted, else
    ``inspected``. A requested run whose profile no longer applies ends as an error."""
    if profile is not None:
        return Trigger.COMMISSION
    stale = _open_run(s, machine_id, REQUESTED)
    if stale is not None:
        stale.status = Status.ERROR.value
        stale.summary = "no enroll rule gives this machine a commissioning profile any more"
        stale.finished_at = utcnow()
        s.add(stale)
    return Trigger.INSPECTED


def start_run(
    s: Session,
    m: Machine,
    profile: CommissioningProfile,
    inventory: NormalizedInventory,
    *,
    actor: str,
    instance: str | None = None,
) -> CommissioningRun:
    """In the inventory's transaction, just after the ``commission`` transition: open the run
    (a requested one, or a new one), record the SKU comparison as its first result, and fail
    the run at once when the hardware is not what the profile says (no point burning in a
    machine with a GPU missing). No commit."""
    now = utcnow()
    run = _open_run(s, m.id, REQUESTED)
    if run is None:
        run = CommissioningRun(
            machine_id=m.id,
            profile=profile.name,
            status=RUNNING,
            spec=profile.model_dump(),
            requested_by=actor,
        )
    run.status, run.profile, run.spec, run.started_at = (
        RUNNING,
        profile.name,
        profile.model_dump(),
        now,
    )
    s.add(run)
    s.flush()
    sku = compare_sku(profile, inventory)
    _add_result(
        s,
        run,
        m.id,
        SKU_CHECK,
        sku,
        agent=None,
        duration_s=0.0,
        raw=None,
        actor=actor,
        instance=instance,
    )
    if not sku.ok or not profile.checks:
        _finish(s, run, m, [(SKU_CHECK, sku)], actor=actor, instance=instance)
    return run


def _add_result(
    s: Session,
    run: CommissioningRun,
    machine_id: str,
    check: str,
    v: Verdict,
    *,
    agent: str | None,
    duration_s: float | None,
    raw: str | None,
    actor: str,
    instance: str | None,
) -> None:
    s.add(
        CommissioningResult(
            run_id=run.id,
            check=check,
            status=v.status.value,
            agent_status=agent,
            duration_s=duration_s,
            sentence=v.sentence[:1000],
            values=v.values,
            raw=None if raw is None else raw[:RAW_LIMIT],
        )
    )
    machines.add_event(
        s,
        f"commissioning.check.{v.status.value}",
        actor,
        machine_id=machine_id,
        reason=f"{check}: {v.sentence}"[:500],
        data={"run": run.id, "check": check, "profile": run.profile, "duration_s": duration_s},
        instance=instance,
    )


def _finish(
    s: Session,
    run: CommissioningRun,
    m: Machine,
    results: list[tuple[str, Verdict]],
    *,
    actor: str,
    instance: str | None,
) -> Machine:
    status, summary = summarise(results)
    run.status, run.summary, run.finished_at = status.value, summary, utcnow()
    s.add(run)
    passed = status is Status.PASSED
    m = machines.transition(
        s,
        m.id,
        Trigger.COMMISSIONED if passed else Trigger.COMMISSION_FAIL,
        actor=actor,
        reason=f"commissioning ({run.profile}) {status.value}: {summary}"[:500],
        data={"commissioning_run": run.id, "profile": run.profile},
        updates={"last_error": None if passed else f"commissioning failed: {summary}"[:1000]},
        instance=instance,
        commit=False,
        machine=m,
    )
    # A machine back from repair: the verdict closes its repair or counts a failure.
    why = f"run {run.id} ({run.profile}) {status.value}: {summary}"
    verdict = repairs.verification_ended(
        s, m, passed=passed, why=why, actor=actor, instance=instance
    )
    if not passed and verdict is None and _was_in_pool(s, m.id, run.id):
        # A machine that passed commissioning before (it was in the pool) and fails now: a
        # person must look at it. Its failed checks go to the repair queue as its evidence.
        failed = [(c, v) for c, v in results if v.status in (Status.FAILED, Status.ERROR)]
        now = utcnow()
        faults = [
            {"kind": "commissioning", "subject": check, "code": v.status.value,
             "severity": "fatal", "witness": "commissioning", "first_seen": now,
             "evidence": f"run {run.id} ({run.profile}) {check} {v.status.value}: {v.sentence}",
             "why": f"commissioning check {check} {v.status.value}"}
            for check, v in failed
        ] or [{"kind": "commissioning", "subject": "run", "code": status.value,
               "severity": "fatal", "witness": "commissioning", "first_seen": now,
               "evidence": why}]  # fmt: skip
        repairs.open_repair(s, m.id, faults=faults, source=repairs.Source.COMMISSIONING,
                            actor=actor, instance=instance, commit=False)  # fmt: skip
        m = machines.get_machine(s, m.id)
    return m


def _was_in_pool(s: Session, machine_id: str, run_id: str) -> bool:
    """Whether the machine passed a commissioning run before this one (it was in the pool)."""
    return (
        s.exec(
            select(CommissioningRun.id)
            .where(
                CommissioningRun.machine_id == machine_id,
                CommissioningRun.status == Status.PASSED.value,
                CommissioningRun.id != run_id,
            )
            .limit(1)
        ).first()
        is not None
    )


def current_run(s: Session, machine_id: str) -> CommissioningRun | None:
    return _open_run(s, machine_id, RUNNING)


def agent_plan(run: CommissioningRun) -> dict[str, Any] | None:
    """What the agent runs (run id, profile, checks), or None while the profile has ``bmc-sel``
    and metald's first reading of the BMC's event log is not stored: no check may start
    before it."""
    if sel_wanted(run) and run.sel_before is None:
        return None
    return {"run_id": run.id, "profile": run.profile, "checks": run_profile(run).plan()}


@dataclass(frozen=True)
class Recorded:
    """What a result post did: the run (its status after the post), the machine's state after
    it, and whether only metald's second reading of the BMC's event log is now missing."""

    run: CommissioningRun
    state: str
    awaits_sel: bool


def record_results(
    s: Session,
    machine_id: str,
    reports: list[CheckReport],
    *,
    done: bool,
    actor: str,
    instance: str | None = None,
    machine: Machine | None = None,
) -> Recorded:
    """The agent's reports for the running run. Each check is judged by metald
    (``judge_check``); a check reported twice, and a report of a check metald runs itself
    (``bmc-sel``), are refused. ``done`` (or every planned check reported) ends the agent's
    part: a planned check never reported is recorded as an error. The run then finishes, unless
    the profile has the ``bmc-sel`` check: then it waits for metald's second reading of the
    BMC's event log (``awaits_sel``, ``finish_with_sel``).

    ``machine`` is the row as the caller just read it in this session (saves a read). The
    post's cost is fixed whatever the run already holds: one read of the machine, one of the
    run, one of the run's earlier verdicts (check, status, sentence: never their values or raw
    output), then only inserts, and on the last post the run's and the machine's updates; the
    run is judged from those verdicts and this post's, never re-read."""
    m = machine if machine is not None else machines.get_machine(s, machine_id)
    run = current_run(s, machine_id)
    if State(m.state) not in COMMISSION_RUNNING or run is None:
        raise Conflict(f"machine {machine_id} is {m.state}, not commissioning; nothing to report")
    profile = CommissioningProfile.model_validate(run.spec)
    planned = {c.name for c in profile.agent_checks()}
    have = _verdicts(s, run.id)
    names = {n for n, _ in have}
    for rep in reports:
        if rep.name in METALD_CHECKS:
            raise Unprocessable(
                f"check {rep.name} is metald's own (read through the BMC); the agent cannot "
                "report it"
            )
        if rep.name not in planned:
            raise Unprocessable(
                f"check {rep.name} is not in this run's plan ({', '.join(sorted(planned))})"
            )
        if rep.name in names:
            raise Conflict(f"check {rep.name} of run {run.id} was already reported")
        names.add(rep.name)  # the same check twice in one post is a second report
    verdicts = [(rep, judge_check(rep, profile, m.arch)) for rep in reports]
    for rep, v in verdicts:
        _add_result(
            s,
            run,
            m.id,
            rep.name,
            v,
            agent=rep.outcome,
            duration_s=rep.duration_s,
            raw=rep.raw,
            actor=actor,
            instance=instance,
        )
    results = have + [(rep.name, v) for rep, v in verdicts]
    awaits = False
    if done or planned <= names:
        for name in sorted(planned - names):
            never = Verdict(Status.ERROR, f"{name} was never reported by the agent")
            _add_result(
                s, run, m.id, name, never, agent=None, duration_s=None, raw=None,
                actor=actor, instance=instance,
            )  # fmt: skip
            results.append((name, never))
        if profile.check(SEL_CHECK) is None:
            m = _finish(s, run, m, results, actor=actor, instance=instance)
        else:
            awaits = SEL_CHECK not in names
    state = m.state
    s.commit()
    return Recorded(run=run, state=state, awaits_sel=awaits)


def _verdicts(s: Session, run_id: str) -> list[tuple[str, Verdict]]:
    """The run's verdicts so far, in the order they were recorded, without their values or
    raw output (what ``summarise`` and the duplicate check need)."""
    rows = s.exec(
        select(CommissioningResult.check, CommissioningResult.status, CommissioningResult.sentence)
        .where(CommissioningResult.run_id == run_id)
        .order_by(col(CommissioningResult.id))
    ).all()
    return [(c, Verdict(Status(st), sentence)) for c, st, sentence in rows]


# --- the BMC's event log before and after (metald's own check, bmc-sel) ----------------------


def sel_wanted(run: CommissioningRun) -> bool:
    return run_profile(run).check(SEL_CHECK) is not None


def awaits_sel(s: Session, run: CommissioningRun) -> bool:
    """The agent's part is over (every planned check has a result) and only metald's second
    reading of the BMC's event log is missing."""
    if run.status != RUNNING or not sel_wanted(run):
        return False
    have = {n for n, _ in _verdicts(s, run.id)}
    planned = {c.name for c in run_profile(run).agent_checks()}
    return SEL_CHECK not in have and planned <= have


def store_sel_before(s: Session, run_id: str, reading: dict[str, Any]) -> bool:
    """Keep the first reading (taken before the agent got its plan); later ones change
    nothing. Returns whether this one was kept."""
    run = s.get(CommissioningRun, run_id)
    if run is None or run.status != RUNNING or run.sel_before is not None:
        return False
    run.sel_before = reading
    s.add(run)
    s.commit()
    return True


def finish_with_sel(
    s: Session,
    run_id: str,
    entries: list[dict[str, Any]] | None,
    *,
    error_text: str | None,
    actor: str,
    instance: str | None = None,
) -> bool:
    """metald's second reading of the BMC's event log: judged against the first, recorded as
    the ``bmc-sel`` result, and the run finished. Nothing happens if the run is no longer
    waiting for it (finished, the watchdog took the machine, already judged)."""
    run = s.get(CommissioningRun, run_id)
    if run is None or not awaits_sel(s, run):
        return False
    m = machines.get_machine(s, run.machine_id)
    if State(m.state) not in COMMISSION_RUNNING:
        return False
    verdict, raw = bmc_sel.judge_sel(run.sel_before, entries, after_error=error_text)
    have = _verdicts(s, run.id)
    _add_result(
        s, run, m.id, SEL_CHECK, verdict, agent=None, duration_s=None, raw=raw,
        actor=actor, instance=instance,
    )  # fmt: skip
    results = [*have, (SEL_CHECK, verdict)]
    _finish(s, run, m, results, actor=actor, instance=instance)
    s.commit()
    return True


#: Reads the machine's BMC event log: ``metald.bmc.service.BmcService.event_log``.
EventLogReader = Callable[[str], Awaitable[list[dict[str, Any]]]]


async def read_event_log(
    reader: EventLogReader | None, machine_id: str, *, timeout_s: float
) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(entries, None) or (None, why): any failure to read is an answer, never a pass."""
    if reader is None:
        return None, "BMC control is not running in this metald instance"
    try:
        return list(await asyncio.wait_for(reader(machine_id), timeout_s)), None
    except TimeoutError:
        return None, f"the BMC did not answer within {timeout_s:g} s"
    except MetaldError as e:
        return None, str(e)
    except Exception as e:  # a driver's own failure: the check is an error, never a pass
        log.warning("machine %s: reading the BMC event log: %r", machine_id, e)
        return None, f"{type(e).__name__} reading the BMC's event log"


class SelReads:
    """The BMC event-log reads of commissioning runs, in the background, once per run and
    phase: requests that ask again wait on the same read. Its task group owns them (a read
    outlives the request that started it), and stopping it cancels those still running."""

    name = "commissioning_sel"

    def __init__(self, *, tasks: TaskScope | None = None) -> None:
        self.tasks = tasks if tasks is not None else TaskScope(self.name)
        self._reads: dict[tuple[str, str], asyncio.Future[None]] = {}

    async def start(self) -> None:
        await self.tasks.open()

    async def stop(self) -> None:
        await self.tasks.close()
        for fut in self._reads.values():
            fut.cancel()
        self._reads.clear()

    def read(
        self,
        phase: str,
        run_id: str,
        machine_id: str,
        *,
        store: Any,
        reader: EventLogReader | None,
        timeout_s: float,
        actor: str,
        instance: str | None = None,
        notify: Callable[[], None] | None = None,
    ) -> asyncio.Future[None]:
        """Read the machine's BMC event log and store what it said: ``before`` (when the agent
        asks for its plan) or ``after`` (when its last check is in; this finishes the run).
        Requests await the returned future for a while and answer without it if the BMC is
        slow; the read outlives them."""
        key = (phase, run_id)
        done = self._reads.get(key)
        if done is not None:
            return done
        done = asyncio.get_running_loop().create_future()
        self._reads[key] = done

        async def go() -> None:
            try:
                entries, why = await read_event_log(reader, machine_id, timeout_s=timeout_s)
                at = utcnow().isoformat()
                try:
                    if phase == "before":
                        doc = bmc_sel.reading(entries, at=at, error_text=why)
                        await store.run(store_sel_before, run_id, doc)
                    else:
                        await store.run(
                            lambda s: finish_with_sel(
                                s, run_id, entries, error_text=why, actor=actor, instance=instance
                            )
                        )
                except Exception:  # a lost race or a store outage: the agent's next request
                    log.exception(  # retries
                        "machine %s: storing the BMC event log reading (%s)", machine_id, phase
                    )
                if notify is not None:
                    notify()
            finally:
                if self._reads.get(key) is done:
                    del self._reads[key]
                if not done.done():
                    done.set_result(None)

        self.tasks.start_soon(go(), name=f"commissioning-sel-{phase}-{run_id}")
        return done


def run_profile(run: CommissioningRun) -> CommissioningProfile:
    return CommissioningProfile.model_validate(run.spec)


def history(s: Session, machine_id: str, limit: int = 20) -> list[dict[str, Any]]:
    """The machine's runs, newest first, each with its results (the raw output of the
    newest run's only)."""
    runs = s.exec(
        select(CommissioningRun)
        .where(CommissioningRun.machine_id == machine_id)
        .order_by(col(CommissioningRun.created_at).desc())
        .limit(limit)
    ).all()
    ids = [r.id for r in runs]
    by_run: dict[str, list[CommissioningResult]] = {i: [] for i in ids}
    if ids:
        for res in s.exec(
            select(CommissioningResult)
            .where(col(CommissioningResult.run_id).in_(ids))
            .order_by(col(CommissioningResult.id))
        ):
            by_run[res.run_id].append(res)
    # Raw output (up to 64 KiB a check) only for the newest run: the history stays small.
    return [
        {
            **run.model_dump(),
            "results": [
                r.model_dump(exclude={"run_id"} if i == 0 else {"run_id", "raw"})
                for r in by_run[run.id]
            ],
        }
        for i, run in enumerate(runs)
    ]


def passed_since(
    s: Session, machine_ids: list[str], *, since: datetime, profile: str | None = None
) -> set[str]:
    """Of ``machine_ids``, those with a passed run finished at or after ``since`` (of
    ``profile`` when given): what a claim's selector asks for."""
    if not machine_ids:
        return set()
    q = select(CommissioningRun.machine_id).where(
        col(CommissioningRun.machine_id).in_(machine_ids),
        CommissioningRun.status == Status.PASSED.value,
        col(CommissioningRun.finished_at) >= since,
    )
    if profile is not None:
        q = q.where(CommissioningRun.profile == profile)
    return set(s.exec(q).all())


def days_ago(days: float, now: datetime | None = None) -> datetime:
    return as_utc(now or utcnow()) - timedelta(days=days)


def require_passed(
    stmt: Any, *, within_days: float | None, profile: str | None, now: datetime | None = None
) -> Any:
    """Narrow a machines query to machines with a passed commissioning run (finished within
    ``within_days``, of ``profile``), in SQL on every backend: what a claim's selector asks."""
    if within_days is None and profile is None:
        return stmt
    cond: list[ColumnElement[bool]] = [
        col(CommissioningRun.machine_id) == col(Machine.id),
        col(CommissioningRun.status) == Status.PASSED.value,
    ]
    if within_days is not None:
        cond.append(col(CommissioningRun.finished_at) >= days_ago(within_days, now))
    if profile is not None:
        cond.append(col(CommissioningRun.profile) == profile)
    return stmt.where(exists().where(*cond))
