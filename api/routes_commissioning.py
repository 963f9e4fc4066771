"""Commissioning over HTTP: technicians start it and read results; the discovery agent asks
what to run and posts what it measured (``metald.commissioning``)."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints
from sqlmodel import Session

from api.roles import AGENT
from api.routes_bmc import ServiceUnavailable
from api.routing import ALL_ROLES, STAFF, ApiRequest, Router
from api.schemas import In
from api.workflows import claim_workflow
from metald import machines
from metald.auth import require_agent_phase
from metald.commissioning.checks import CheckReport
from metald.commissioning.profile import CommissioningProfile
from metald.errors import Conflict
from metald.inventory.normalize import NormalizedInventory
from metald.inventory.rules import profile_for
from metald.lifecycle import COMMISSION_RUNNING, State
from metald.provision import commissioning as runs
from metald.store.models import Machine
from metald.usecases.machines import load_visible

router = Router()
TAG = "commissioning"
#: How long an agent's request waits for metald's reading of the BMC event log (bmc-sel)
#: before it is answered without it; the agent's own requests give up at 30 s.
SEL_WAIT_S = 20.0


class ResultOut(BaseModel):
    id: int | None
    check: str
    status: str
    agent_status: str | None
    duration_s: float | None
    sentence: str
    values: dict[str, Any]
    #: The tool's output as the agent posted it (up to 64 KiB); only in the last run.
    raw: str | None = None
    at: datetime


class RunOut(BaseModel):
    id: str
    machine_id: str
    profile: str
    status: str
    spec: dict[str, Any]
    requested_by: str
    summary: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    results: list[ResultOut]


class CommissioningOut(BaseModel):
    machine_id: str
    state: str
    #: The newest run (requested, running or finished), or null.
    last: RunOut | None
    #: Older runs, newest first.
    history: list[RunOut]


class CommissionIn(In):
    reason: Annotated[str, StringConstraints(max_length=500)] | None = None


class PlanOut(BaseModel):
    run_id: str
    profile: str
    #: The checks to run, each with name, timeout_s, duration_s, level, required.
    checks: list[dict[str, Any]]


class ResultsIn(In):
    results: list[CheckReport] = Field(max_length=32)
    #: The agent has run everything it will: checks not reported are errors.
    done: bool = False


class ResultsAccepted(BaseModel):
    run_id: str
    status: str
    state: str


def _out(s: Session, machine_id: str) -> CommissioningOut:
    m = machines.get_machine(s, machine_id)
    hist = [RunOut.model_validate(r) for r in runs.history(s, machine_id)]
    return CommissioningOut(
        machine_id=m.id, state=m.state, last=hist[0] if hist else None, history=hist[1:]
    )


@router.route(
    "GET",
    "/api/v1/machines/{id}/commissioning",
    summary="Show a machine's commissioning",
    roles=ALL_ROLES,
    response=CommissioningOut,
    tag=TAG,
    errors=(404,),
)
async def show_commissioning(req: ApiRequest) -> CommissioningOut:
    """The last commissioning run (each check: metald's verdict, the agent's outcome, the
    duration, the measured values, the raw output up to 64 KiB) and the earlier runs."""
    p = req.require_principal()

    def run(s: Session) -> CommissioningOut:
        return _out(s, load_visible(s, p, req.params["id"]).id)

    return await req.ctx.store.run(run)


@router.route(
    "POST",
    "/api/v1/machines/{id}/commission",
    summary="Commission a machine (again)",
    roles=STAFF,
    body=CommissionIn,
    response=CommissioningOut,
    status=202,
    tag=TAG,
    errors=(404, 409, 422),
)
async def commission(req: ApiRequest) -> CommissioningOut:
    """From ready, maintenance or commission-failed (a retry after a repair): the machine is
    inspected again (power-cycled into PXE through its BMC) and commissioned with the profile
    the enroll rules give its inventory; the run starts when the fresh inventory arrives."""
    b: CommissionIn = req.body
    p = req.require_principal()
    rules = req.ctx.cfg.enroll.rules

    def profile_of(m: Machine) -> CommissioningProfile | None:
        inv = (m.inventory or {}).get("normalized")
        if inv is None:
            return None
        return profile_for(rules, NormalizedInventory.model_validate(inv), m.rack_position)

    return await claim_workflow(req.ctx).commission(
        req.params["id"],
        actor=req.actor,
        load=lambda s, mid: load_visible(s, p, mid),
        render=lambda s, m: _out(s, m.id),
        profile_of=profile_of,
        reason=b.reason,
    )


def _agent_machine(req: ApiRequest, s: Session) -> Machine:
    p = req.require_principal()
    mid = next(iter(p.scope))
    m = machines.get_machine(s, mid)
    require_agent_phase(p, m.state, {"inspect"})
    if State(m.state) not in COMMISSION_RUNNING:
        raise Conflict(f"machine {mid} is {m.state}, not commissioning; ask /api/v1/agent/next")
    if p.boot is not None and p.boot != m.boot_current:
        raise Conflict("this agent token belongs to an earlier boot of the machine; boot again")
    return m


@router.route(
    "GET",
    "/api/v1/agent/commissioning",
    summary="Get the commissioning checks to run",
    roles=AGENT,
    response=PlanOut,
    tag="agent",
    errors=(409, 503),
)
async def agent_plan(req: ApiRequest) -> PlanOut:
    """While the machine is commissioning: the checks its profile selects, with timeouts.
    With the ``bmc-sel`` check, metald first reads the BMC's event log (503 while it is at it:
    ask again)."""

    def run(s: Session) -> tuple[str, str, bool, PlanOut]:
        mid = _agent_machine(req, s).id
        r = runs.current_run(s, mid)
        if r is None:
            raise Conflict(f"machine {mid} has no running commissioning run")
        plan = PlanOut(run_id=r.id, profile=r.profile, checks=runs.run_profile(r).plan())
        return mid, r.id, runs.sel_wanted(r) and r.sel_before is None, plan

    mid, run_id, need_sel, plan = await req.ctx.store.read_aside(run)
    if need_sel:
        done, _ = await asyncio.wait({_sel_read(req, "before", run_id, mid)}, timeout=SEL_WAIT_S)
        if not done:
            raise ServiceUnavailable(
                "metald is reading the machine's BMC event log before the checks start; "
                "ask again in a few seconds"
            )
    return plan


def _sel_read(req: ApiRequest, phase: str, run_id: str, machine_id: str) -> asyncio.Task[Any]:
    bmc = req.ctx.services.get("bmc")
    return runs.sel_read(
        phase,
        run_id,
        machine_id,
        store=req.ctx.store,
        reader=None if bmc is None else bmc.event_log,
        timeout_s=req.ctx.cfg.bmc.sensors_timeout_s * (req.ctx.cfg.bmc.retries + 2),
        actor=req.actor,
        instance=req.ctx.instance,
        notify=req.ctx.bus.notify,
    )


@router.route(
    "POST",
    "/api/v1/agent/commissioning",
    summary="Post commissioning check results",
    roles=AGENT,
    body=ResultsIn,
    response=ResultsAccepted,
    tag="agent",
    errors=(409, 422),
)
async def agent_results(req: ApiRequest) -> ResultsAccepted:
    """The agent's reports (outcome, exit code, duration, raw output up to 64 KiB). metald
    judges each check from the raw output itself; the agent's verdict is never taken. When
    every planned check is in (or ``done``), the machine goes to ready or commission-failed;
    with the ``bmc-sel`` check, once metald has read the BMC's event log again."""
    b: ResultsIn = req.body

    def run(s: Session) -> tuple[ResultsAccepted, bool]:
        m = _agent_machine(req, s)
        rec = runs.record_results(
            s, m.id, b.results, done=b.done, actor=req.actor, instance=req.ctx.instance, machine=m
        )
        out = ResultsAccepted(run_id=rec.run.id, status=rec.run.status, state=rec.state)
        return out, rec.awaits_sel

    out, awaits = await req.write(run)
    if awaits:
        task = _sel_read(req, "after", out.run_id, next(iter(req.require_principal().scope)))
        await asyncio.wait({task}, timeout=SEL_WAIT_S)

        def reread(s: Session) -> ResultsAccepted:
            r = s.get(runs.CommissioningRun, out.run_id)
            m = machines.get_machine(s, r.machine_id if r else "")
            return ResultsAccepted(run_id=out.run_id, status=r.status if r else "", state=m.state)

        out = await req.ctx.store.read_aside(reread)
    return out
