"""/api/v1/health: what a tenant node reports about itself, with its own node token."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from api.routes_mesh import _bearer
from api.routing import ApiRequest, Router
from api.schemas import In
from metald.usecases import health

router = Router()

#: The agent sends at most 1 MiB (docs/health.md); a little room for the JSON around it.
MAX_REPORT_BYTES = 1_200_000


class HealthReport(In):
    """Raw tool output, as the node agent collects it (``metald.health.node.NodeReport``).
    No witness, verdict or severity: metald computes them."""

    version: int = Field(default=1, ge=1, le=1)
    kernel_log: str = Field(default="", max_length=128 * 1024)
    nvidia_smi_xml: str | None = Field(default=None, max_length=1024 * 1024)
    nvlink: str | None = Field(default=None, max_length=64 * 1024)
    smart: str | None = Field(default=None, max_length=512 * 1024)
    ib_ports: str | None = Field(default=None, max_length=64 * 1024)
    #: ``dcgmi health --check --json`` where DCGM runs with health watches set.
    dcgm_health: str | None = Field(default=None, max_length=64 * 1024)


class HealthReportOut(BaseModel):
    #: Seconds until the next report.
    interval_s: int
    #: Signals read from the report, and faults it opened.
    signals: int
    new_faults: int
    #: Parts of the report metald could not read, in a sentence each.
    unreadable: list[str]


@router.route(
    "POST",
    "/api/v1/health/report",
    summary="Report a node's health",
    roles=None,
    body=HealthReport,
    response=HealthReportOut,
    tag="tenants",
    errors=(401, 403, 413, 422, 429),
    max_body=MAX_REPORT_BYTES,
)
async def health_report(req: ApiRequest) -> HealthReportOut:
    """Called by a tenant node's agent with its node token (``Authorization: Bearer mnt_...``,
    from its join answer; no other token works here). The body is raw tool output; metald
    parses and classifies it itself, and records what it finds as the node's word (it can make
    the machine look worse, never better). Answers when to report next; 429 with Retry-After
    when the node reports sooner than ``[health] report_min_interval_s``."""
    b: HealthReport = req.body
    watch = req.ctx.services.health_watch
    out = await health.node_report(
        req.ctx.store,
        _bearer(req),
        b.model_dump(exclude={"version"}),
        cfg=req.ctx.cfg.health,
        instance=req.ctx.instance,
        wake=watch.wake if watch else lambda: None,
        memo=watch.report_memo if watch else None,
        limit=req.ctx.intake("health-reports"),
        source=req.raw.remote or "",
    )
    return HealthReportOut.model_validate(out)


#: A Redfish Event with a few entries is a few KiB; room for a BMC that sends 32 at once.
MAX_EVENT_BYTES = 64 * 1024
#: The header metald asks the BMC to send with each event (``HttpHeaders`` of the subscription).
SECRET_HEADER = "X-Metald-Event-Secret"


class BmcEventIn(BaseModel):
    """A Redfish ``Event`` (``#Event.v1_x_x.Event``) as a BMC pushes it. Fields metald does not
    read are ignored."""

    model_config = ConfigDict(extra="ignore")

    Context: str | None = Field(default=None, max_length=512)
    Events: list[Any] = Field(default_factory=list, max_length=64)


class BmcEventOut(BaseModel):
    #: Entries read from the event, signals not seen before (pushed or polled), faults opened.
    entries: int
    signals: int
    new_faults: int


@router.route(
    "POST",
    "/api/v1/bmc-events/{bmc_id}",
    summary="Receive a BMC's pushed Redfish event",
    roles=None,
    body=BmcEventIn,
    response=BmcEventOut,
    tag="machines",
    errors=(401, 413, 415, 422, 429),
    max_body=MAX_EVENT_BYTES,
)
async def bmc_event(req: ApiRequest) -> BmcEventOut:
    """Called by a Redfish BMC on its EventService subscription, which the BMC's owning
    instance made (docs/health.md). The BMC proves it is that subscription's with the secret
    metald gave it: the ``X-Metald-Event-Secret`` header, else the event's ``Context``; no
    token works here, and one BMC's secret is refused for another. The entries are recorded as
    the BMC's word, as its polled event log is. 429 with Retry-After past ``[health.intake]``
    (per BMC, per source address, in all), before the secret is checked."""
    b: BmcEventIn = req.body
    watch = req.ctx.services.health_watch
    secret = req.raw.headers.get(SECRET_HEADER) or b.Context
    out = await health.bmc_event(
        req.ctx.store,
        req.params["bmc_id"],
        secret,
        b.Events,
        cfg=req.ctx.cfg.health,
        instance=req.ctx.instance,
        wake=watch.wake if watch else lambda: None,
        limit=req.ctx.intake("bmc-events"),
        source=req.raw.remote or "",
    )
    return BmcEventOut.model_validate(out)
