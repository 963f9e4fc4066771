"""Commissioning over HTTP: technicians start it and read results; the discovery agent asks
what to run and posts what it measured (``metald.commissioning``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints

from api import workflows
from api.roles import AGENT
from api.routing import ALL_ROLES, STAFF, ApiRequest, Router
from api.schemas import In
from metald.commissioning.checks import CheckReport
from metald.errors import ServiceUnavailable
from metald.usecases.commissioning import Commissioning

router = Router()
TAG = "commissioning"


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


@router.route(
    "GET",
    "/api/v1/machines/{id}/commissioning",
    summary="Show a machine's commissioning",
    roles=ALL_ROLES,
    response=CommissioningOut,
    tag=TAG,
    errors=(404,),
    use_case=workflows.commissioning,
)
async def show_commissioning(req: ApiRequest, commissioning: Commissioning) -> CommissioningOut:
    """The last commissioning run (each check: metald's verdict, the agent's outcome, the
    duration, the measured values, the raw output up to 64 KiB) and the earlier runs."""
    return CommissioningOut.model_validate(
        await commissioning.show(req.require_principal(), req.params["id"])
    )


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
    use_case=workflows.commissioning,
)
async def commission(req: ApiRequest, commissioning: Commissioning) -> CommissioningOut:
    """From ready, maintenance or commission-failed (a retry after a repair): the machine is
    inspected again (power-cycled into PXE through its BMC) and commissioned with the profile
    the enroll rules give its inventory; the run starts when the fresh inventory arrives."""
    b: CommissionIn = req.body
    out = await commissioning.commission(
        req.require_principal(), req.params["id"], actor=req.actor, reason=b.reason
    )
    return CommissioningOut.model_validate(out)


@router.route(
    "GET",
    "/api/v1/agent/commissioning",
    summary="Get the commissioning checks to run",
    roles=AGENT,
    response=PlanOut,
    tag="agent",
    errors=(409, 503),
    use_case=workflows.commissioning,
)
async def agent_plan(req: ApiRequest, commissioning: Commissioning) -> PlanOut:
    """While the machine is commissioning: the checks its profile selects, with timeouts.
    With the ``bmc-sel`` check, metald first reads the BMC's event log (503 while it is at it:
    ask again)."""
    plan = await commissioning.agent_plan(req.require_principal(), actor=req.actor)
    if plan is None:
        raise ServiceUnavailable(
            "metald is reading the machine's BMC event log before the checks start; "
            "ask again in a few seconds"
        )
    return PlanOut.model_validate(plan)


@router.route(
    "POST",
    "/api/v1/agent/commissioning",
    summary="Post commissioning check results",
    roles=AGENT,
    body=ResultsIn,
    response=ResultsAccepted,
    tag="agent",
    errors=(409, 422),
    use_case=workflows.commissioning,
)
async def agent_results(req: ApiRequest, commissioning: Commissioning) -> ResultsAccepted:
    """The agent's reports (outcome, exit code, duration, raw output up to 64 KiB). metald
    judges each check from the raw output itself; the agent's verdict is never taken. When
    every planned check is in (or ``done``), the machine goes to ready or commission-failed;
    with the ``bmc-sel`` check, once metald has read the BMC's event log again."""
    b: ResultsIn = req.body
    out = await commissioning.agent_results(
        req.require_principal(), b.results, done=b.done, actor=req.actor
    )
    return ResultsAccepted.model_validate(out)
