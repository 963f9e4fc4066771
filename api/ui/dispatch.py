"""The console acts and reads through the API's own routes, in process: the same
declaration decides who may (``api.routing.authorize``), the same models validate the body
and query, and the same handler scopes what an orchestrator sees. The console adds no second
copy of any rule; it only renders the answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from api.problem import describe_validation
from api.resolve import path_kinds, resolve_refs_of
from api.routing import (
    ApiRequest,
    Refusal,
    RouteSpec,
    SessionCaller,
    authorize,
    check_json_values,
    check_path,
    validate_query,
    wire_json,
)
from api.ui.guard import UiRequest
from metald.errors import MetaldError
from metald.lifecycle import IllegalTransition
from metald.usecases.names import resolve_params


@dataclass
class Refused(Exception):
    """An API refusal as the console shows it: the problem's status, title and sentence."""

    status: int
    title: str
    detail: str


class Api:
    """The API's route declarations, by (method, path)."""

    def __init__(self, specs: list[RouteSpec]) -> None:
        self.specs = {(s.method, s.path): s for s in specs}

    def spec(self, method: str, path: str) -> RouteSpec:
        return self.specs[(method, path)]

    def allows(self, ui: UiRequest, method: str, path: str) -> bool:
        """Whether the caller's role may use the route (for links and pages)."""
        roles = self.spec(method, path).roles
        return roles is None or ui.principal.role in roles

    async def call(
        self,
        ui: UiRequest,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        query: dict[str, Any] | None = None,
        body: dict[str, Any] | None = None,
    ) -> Any:
        """The route's answer for this caller, as JSON-ready data, or Refused."""
        spec = self.spec(method, path)
        result = await self.invoke(ui, spec, params or {}, query, body, ui.raw)
        if isinstance(result, web.StreamResponse):
            return result
        data = result.model_dump() if isinstance(result, BaseModel) else result
        return wire_json(data)

    async def invoke(
        self,
        ui: UiRequest,
        spec: RouteSpec,
        params: dict[str, str],
        query: dict[str, Any] | None,
        body: dict[str, Any] | None,
        raw: web.Request,
        session: SessionCaller | None = None,
    ) -> Any:
        try:
            authorize(spec, ui.principal)
            check_path(params)  # ids from the console's forms and links: the API's checks
            params = await resolve_params(ui.ctx.store, ui.principal, path_kinds(spec.path), params)
            areq = ApiRequest(raw, ui.ctx, ui.principal, params=params, session=session)
            if spec.query is not None:
                areq.query = validate_query(spec.query, query or {})
            if spec.body is not None:
                check_json_values(body or {})  # form text (a reason): the API's body check
                areq.body = body if spec.raw_body else spec.body.model_validate(body or {})
            areq.query, areq.body = await resolve_refs_of(ui.ctx.store, ui.principal, areq)
            return await spec.handler(areq)
        except Refusal as p:
            raise Refused(p.status, p.title, p.detail) from None
        except ValidationError as e:
            sentence, _ = describe_validation(e)
            raise Refused(
                422, "Invalid request", f"the request does not validate: {sentence}"
            ) from None
        except IllegalTransition as e:
            raise Refused(409, "Illegal transition", str(e)) from None
        except MetaldError as e:
            raise Refused(e.status, e.title, e.detail) from None
