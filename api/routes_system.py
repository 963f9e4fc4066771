"""/healthz, /metrics and /api/v1/openapi.json."""

from __future__ import annotations

from aiohttp import web

from api.routing import ApiRequest, Router
from api.schemas import Health
from metald import __version__, metrics
from metald.usecases import gauges
from metald.usecases.system import database_status

router = Router()


@router.route("GET", "/healthz", summary="Check health", roles=None, response=Health, tag="system")
async def healthz(req: ApiRequest) -> web.StreamResponse:
    """200 when the database answers, 503 otherwise. No authentication (for load balancers)."""
    fleet = req.ctx.services.fleet
    if fleet is not None and fleet.fenced:
        db = "fenced: no heartbeat confirmed within the lease (not asked)"
    else:
        db = await database_status(req.ctx.store)
    services = req.ctx.services.health()
    body = Health(
        status="ok" if db == "ok" else "degraded",
        database=db,
        version=__version__,
        instance=req.ctx.instance,
        services=services,
    )
    return web.json_response(body.model_dump(), status=200 if db == "ok" else 503)


@router.route(
    "GET",
    "/metrics",
    summary="Export Prometheus metrics",
    roles=None,
    tag="system",
    raw_response="text/plain",
)
async def show_metrics(req: ApiRequest) -> web.Response:
    """Prometheus text format: API, lifecycle, DHCP/TFTP and BMC counters."""
    fleet = req.ctx.services.fleet
    if fleet is None or not fleet.fenced:  # fenced: this process's counters, no store gauges
        await gauges.refresh(req.ctx.store, req.ctx.cfg.boot.networks)
    return web.Response(body=metrics.render(), content_type="text/plain", charset="utf-8")
