"""The web console at /ui/ on the staff listener: server-rendered pages over the API's own
routes (docs/ui.md). ``setup`` adds its routes to the API application."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from api.ui.dispatch import Api
from api.ui.guard import UI_CTX, make
from api.ui.live import Live
from api.ui.views import Views

if TYPE_CHECKING:
    from api.context import AppContext
    from api.routing import RouteSpec

STATIC = Path(__file__).parent / "static"


def setup(app: web.Application, ctx: AppContext, specs: list[RouteSpec]) -> None:
    api = Api(specs)
    views, live = Views(api), Live(api)
    app[UI_CTX] = ctx

    def page(fn, action: bool = False):  # type: ignore[no-untyped-def]
        return make(fn, ctx, action=action)

    async def to_console(_request: web.Request) -> web.StreamResponse:
        raise web.HTTPPermanentRedirect("/ui/")

    app.router.add_get("/ui", to_console)
    app.router.add_get("/ui/login", views.login_form)
    app.router.add_post("/ui/login", views.login)
    app.router.add_post("/ui/logout", page(views.logout, action=True))
    app.router.add_get("/ui/", page(views.fleet))
    app.router.add_get("/ui/fleet/rows", page(views.fleet_rows))
    app.router.add_get("/ui/racks", page(views.racks))
    app.router.add_post("/ui/machines/bulk", page(views.bulk, action=True))
    app.router.add_get("/ui/machines/{id}", page(views.machine))
    app.router.add_post("/ui/machines/{id}/act", page(views.act, action=True))
    app.router.add_get("/ui/machines/{id}/console", live.console)
    app.router.add_get("/ui/machines/{id}/{what:sensors|bmc-log}", page(views.sensors))
    app.router.add_get("/ui/claims", page(views.claims))
    app.router.add_get("/ui/claims/{id}", page(views.claim_fragment))
    app.router.add_get("/ui/tenants", page(views.tenants))
    app.router.add_get("/ui/repairs", page(views.repairs))
    app.router.add_post(
        "/ui/repairs/{id}/{action:take|note|repaired|release}",
        page(views.repair_action, action=True),
    )
    app.router.add_get("/ui/events", page(views.events))
    app.router.add_get("/ui/events/stream", page(live.events))
    app.router.add_get("/ui/firmware", page(views.firmware))
    app.router.add_get("/ui/instances", page(views.instances))
    app.router.add_get("/ui/topology", page(views.topology))
    app.router.add_get("/ui/tokens", page(views.tokens))
    app.router.add_static("/ui/static/", STATIC, append_version=False)
