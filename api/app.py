"""Build the aiohttp application: every route module, problem+json for the rest, OpenAPI."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from api import (
    routes_agent,
    routes_attestation,
    routes_bmc,
    routes_claims,
    routes_commissioning,
    routes_console,
    routes_elastic,
    routes_events,
    routes_firmware,
    routes_health,
    routes_images,
    routes_instances,
    routes_join,
    routes_machines,
    routes_mesh,
    routes_repairs,
    routes_system,
    routes_tenants,
    routes_tokens,
    routes_topology,
    ui,
)
from api.context import AppContext
from api.openapi import build_openapi
from api.problem import problem
from api.routing import Router, RouteSpec, add_routes
from metald.lifecycle import IllegalTransition
from metald.store.db import store_unavailable

log = logging.getLogger("metald.api")

CTX_KEY = web.AppKey("ctx", AppContext)
#: A client must send its whole request head within this many seconds of connecting (and of
#: its previous response, on a kept-alive connection); then it is disconnected.
HEADER_TIMEOUT_S = 15.0
#: Retry-After of a 503 answered while the database is unreachable.
RETRY_AFTER_S = 2


def server_settings(*, header_timeout_s: float = HEADER_TIMEOUT_S) -> dict[str, Any]:
    """aiohttp server settings for the API listener (``web.AppRunner(app, **...)``).

    aiohttp arms its keep-alive timer when a connection opens and closes the connection when
    it fires while no complete request head has arrived: that is the header-read timeout, so
    half-sent heads cannot hold sockets for long. Handlers already running are not affected."""
    return {"keepalive_timeout": header_timeout_s}


#: One routes module per URL prefix (``/api/v1/<prefix>``); the BMC subsystem's routes, also
#: those on a machine (power, boot device, sensors, log), are ``routes_bmc``'s.
ROUTERS: list[Router] = [
    routes_system.router,
    routes_machines.router,
    routes_events.router,
    routes_tokens.router,
    routes_instances.router,
    routes_bmc.router,
    routes_console.router,
    routes_agent.router,
    routes_commissioning.router,
    routes_attestation.router,
    routes_firmware.router,
    routes_claims.router,
    routes_elastic.router,
    routes_images.router,
    routes_tenants.router,
    routes_join.router,
    routes_mesh.router,
    routes_topology.router,
    routes_repairs.router,
    routes_health.router,
]


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except IllegalTransition as e:
        return problem(
            409,
            "Illegal transition",
            str(e),
            instance=request.path,
            state=e.state.value,
            allowed_actions=e.allowed_triggers,
        )
    except web.HTTPNotFound:
        return problem(
            404, "Not found", f"there is no resource at {request.path}", instance=request.path
        )
    except web.HTTPMethodNotAllowed as e:
        allowed = ", ".join(sorted(e.allowed_methods))
        resp = problem(
            405,
            "Method not allowed",
            f"{request.method} is not allowed here; use {allowed}",
            instance=request.path,
        )
        resp.headers["Allow"] = allowed  # RFC 9110 15.5.6: a 405 MUST carry Allow
        return resp
    except web.HTTPException:
        raise
    except Exception as e:
        if store_unavailable(e):
            log.warning("%s %s: database unavailable: %s", request.method, request.path, e)
            return problem(
                503,
                "Database unavailable",
                "metald cannot reach its database right now (it is restarting, or this "
                "instance is cut off from it): retry the request after Retry-After seconds",
                instance=request.path,
                retry_after_s=RETRY_AFTER_S,
            )
        log.exception("unhandled error in %s %s", request.method, request.path)
        return problem(
            500,
            "Internal error",
            "metald hit an unexpected error; it is logged with this path",
            instance=request.path,
        )


@web.middleware
async def tenant_node_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Tenant machines reach only the join, agent and boot endpoints (metald/nodeguard.py)."""
    guard = request.app[CTX_KEY].services.tenant_node_guard
    if guard is not None and guard.refuses(request.remote, request.path):
        log.warning(
            "refused %s %s from tenant machine %s", request.method, request.path, request.remote
        )
        return problem(
            403,
            "Forbidden",
            "a tenant's machine may reach only /api/v1/join, /api/v1/mesh, /api/v1/agent/ "
            "and /boot/",
            instance=request.path,
        )
    return await handler(request)


#: What a fenced instance still serves itself: no store behind them (health and metrics say
#: "fenced" without asking the store; the OpenAPI document and boot assets are files).
FENCED_SERVES = frozenset({"/healthz", "/metrics", "/api/v1/openapi.json"})
FENCED_SERVES_UNDER = ("/boot/assets/",)


def fenced(ctx: AppContext) -> bool:
    """Whether this instance fenced itself (no heartbeat confirmed within its lease)."""
    fleet = ctx.services.fleet
    return fleet is not None and fleet.fenced


@web.middleware
async def fenced_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A fenced instance answers 503 at once for everything that needs the store or ownership,
    instead of first waiting on a store it cannot reach (seconds per request during a cut)."""
    path = request.path
    if (
        path in FENCED_SERVES
        or path.startswith(FENCED_SERVES_UNDER)
        or not fenced(request.app[CTX_KEY])
    ):
        return await handler(request)
    ctx = request.app[CTX_KEY]
    return problem(
        503,
        "Instance fenced",
        f"this metald instance ({ctx.instance}) has no heartbeat confirmed by the database "
        "within its lease, so it owns nothing and does not use the store: send the request "
        "to another instance, or retry here after Retry-After seconds",
        instance=path,
        retry_after_s=RETRY_AFTER_S,
    )


def all_specs(routers: list[Router]) -> list[RouteSpec]:
    return [s for r in routers for s in r.specs]


def create_app(ctx: AppContext, *, extra: list[web.RouteDef] | None = None) -> web.Application:
    app = web.Application(
        middlewares=[errors_middleware, tenant_node_middleware, fenced_middleware],
        client_max_size=max(ctx.cfg.api.max_body_bytes, 4 << 20),
    )
    routers = ROUTERS
    for r in routers:
        add_routes(app, r, ctx)
    document = build_openapi(all_specs(routers))

    async def openapi(_request: web.Request) -> web.Response:
        return web.json_response(document)

    app.router.add_get("/api/v1/openapi.json", openapi)
    ui.setup(app, ctx, all_specs(routers))
    if extra:
        app.add_routes(extra)
    app[CTX_KEY] = ctx
    ctx.bus.bind(ctx.store)

    async def close_streams(_app: web.Application) -> None:
        await ctx.bus.close()

    app.on_shutdown.append(close_streams)
    return app
