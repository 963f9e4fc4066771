"""Commissioning runs in the store: start one when an inventory arrives and a profile applies,
record each check's result (metald's verdict, recomputed), finish the run with the machine's
transition, and read the last run and history.

Every function takes an open ``Session``; ``record_results`` commits results, events and the
final transition in one transaction.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import exists
from sqlmodel import Session, col, select

from metald import machines
from metald.commissioning.checks import RAW_LIMIT, CheckReport, judge_check, summarise
from metald.commissioning.profile import SKU_CHECK, CommissioningProfile, compare_sku
from metald.commissioning.verdict import Status, Verdict
from metald.errors import Conflict, Unprocessable
from metald.inventory.normalize import NormalizedInventory
from metald.inventory.rules import profile_for
from metald.lifecycle import COMMISSION_REQUESTABLE, COMMISSION_RUNNING, State, Trigger
from metald.store.models import CommissioningResult, CommissioningRun, Machine, as_utc, utcnow

REQUESTED, RUNNING = "requested", "running"
#: Run statuses that end it.
FINAL = frozenset({Status.PASSED.value, Status.FAILED.value, Status.ERROR.value})


def _open_run(s: Session, machine_id: str, status: str) -> CommissioningRun | None:
    return s.exec(
        select(CommissioningRun)
        .where(CommissioningRun.machine_id == machine_id, CommissioningRun.status == status)
        .order_by(col(CommissioningRun.created_at).desc())
    ).first()


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
    if profile is None or not profile.on_release:
        return False
    request_run(
        s,
        m.id,
        profile=profile,
        actor=actor,
        reason=f"commissioning again after release (profile {profile.name} asks on_release)",
        instance=instance,
    )
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
) -> None:
    status, summary = summarise(results)
    run.status, run.summary, run.finished_at = status.value, summary, utcnow()
    s.add(run)
    passed = status is Status.PASSED
    machines.transition(
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


def current_run(s: Session, machine_id: str) -> CommissioningRun | None:
    return _open_run(s, machine_id, RUNNING)


def record_results(
    s: Session,
    machine_id: str,
    reports: list[CheckReport],
    *,
    done: bool,
    actor: str,
    instance: str | None = None,
) -> CommissioningRun:
    """The agent's reports for the running run. Each check is judged by metald
    (``judge_check``); a check reported twice is refused. ``done`` (or every planned check
    reported) finishes the run: a planned check never reported is an error."""
    m = machines.get_machine(s, machine_id)
    run = current_run(s, machine_id)
    if State(m.state) not in COMMISSION_RUNNING or run is None:
        raise Conflict(f"machine {machine_id} is {m.state}, not commissioning; nothing to report")
    profile = CommissioningProfile.model_validate(run.spec)
    planned = {c.name for c in profile.checks}
    have = {
        r.check: r
        for r in s.exec(select(CommissioningResult).where(CommissioningResult.run_id == run.id))
    }
    for rep in reports:
        if rep.name not in planned:
            raise Unprocessable(
                f"check {rep.name} is not in this run's plan ({', '.join(sorted(planned))})"
            )
        if rep.name in have:
            raise Conflict(f"check {rep.name} of run {run.id} was already reported")
    verdicts = [(rep, judge_check(rep, profile)) for rep in reports]
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
    s.flush()
    reported = set(have) | {rep.name for rep in reports}
    if done or planned <= reported:
        results = [(c, Verdict(Status(r.status), r.sentence, r.values)) for c, r in have.items()]
        results += [(rep.name, v) for rep, v in verdicts]
        results += [
            (name, Verdict(Status.ERROR, f"{name} was never reported by the agent"))
            for name in sorted(planned - reported)
        ]
        _finish(s, run, m, results, actor=actor, instance=instance)
    s.commit()
    return run


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
    cond = [
        col(CommissioningRun.machine_id) == col(Machine.id),
        CommissioningRun.status == Status.PASSED.value,
    ]
    if within_days is not None:
        cond.append(col(CommissioningRun.finished_at) >= days_ago(within_days, now))
    if profile is not None:
        cond.append(CommissioningRun.profile == profile)
    return stmt.where(exists().where(*cond))
