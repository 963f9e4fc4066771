"""Route definitions that carry their own contract: roles, body, query and response models.

Every API handler is declared with ``Router.route(...)``. The declaration is used three times:
to wire the aiohttp route, to enforce authentication/role/body/query rules before the handler
runs, and to generate ``/api/v1/openapi.json`` — so the document cannot drift from the code.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import json
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import StreamReader, web
from aiohttp.web_protocol import RequestPayloadError
from multidict import MultiMapping
from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python
from sqlalchemy import event

from api import forwarding
from api.paging import INT64_MAX, INT64_MIN, next_link
from api.problem import problem, validation_problem
from api.resolve import path_kinds, resolve_refs_of
from metald import metrics
from metald.auth import Principal, Role, record_first_use
from metald.errors import MetaldError, ServiceUnavailable
from metald.fleet import forward_auth
from metald.machines import ConcurrentUpdate
from metald.usecases.names import resolve_params
from metald.usecases.tokens import principal_of, record_use

if TYPE_CHECKING:
    from api.context import AppContext

Handler = Callable[["ApiRequest"], Awaitable[Any]]

ALL_ROLES = frozenset(Role)
STAFF = frozenset({Role.ADMIN, Role.TECHNICIAN})


class Owner(enum.Enum):
    """Which instance of a fleet runs a route's handler: the one that owns the BMC the path's
    ``{id}`` names. A route declared with an owner (``Router.route(..., owner=Owner.BMC)``)
    runs where it lands only on that instance (or in a single instance); on any other, the
    router carries it there (``api.forwarding``) and answers what the owner answers."""

    #: The BMC ``{id}`` (``/api/v1/bmcs/{id}/...``).
    BMC = "bmc"
    #: The BMC of the machine ``{id}`` (``/api/v1/machines/{id}/...``).
    MACHINE = "machine"
    #: The BMC of the machine ``{id}``, over a WebSocket carried frame by frame (the serial
    #: console). A request that is not a WebSocket upgrade runs here (the route refuses it).
    CONSOLE = "console"


@dataclass
class RouteSpec:
    method: str
    path: str
    handler: Handler
    summary: str
    roles: frozenset[Role] | None  # None: no authentication (firmware, health probes)
    body: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    status: int = 200
    tag: str = ""
    description: str = ""
    raw_response: str | None = None  # media type for non-JSON responses
    errors: tuple[int, ...] = ()
    #: Pass the decoded JSON object to the handler unvalidated (it validates itself, e.g. to
    #: record refusals); ``body`` then only documents the shape.
    raw_body: bool = False
    #: Body limit for this route when it differs from api.max_body_bytes; for a WebSocket
    #: route (``Owner.CONSOLE``), the largest frame it takes.
    max_body: int | None = None
    #: For a route that creates (201): the created resource's path, formatted with the
    #: response's fields and the path parameters, sent as ``Location``.
    location: str | None = None
    #: The route writes a versioned row and honours ``If-Match`` (its ETag is the version).
    versioned: bool = False
    #: Builds the use case (``metald.usecases``) the handler delegates to, from the request;
    #: the handler is then called as ``handler(req, use_case)``.
    use_case: Callable[[ApiRequest], Any] | None = None
    #: Which instance of a fleet runs the handler (``Owner``); None: whichever it reaches.
    owner: Owner | None = None

    @property
    def path_params(self) -> list[str]:
        return re.findall(r"{(\w+)(?::[^}]*)?}", self.path)

    @property
    def openapi_path(self) -> str:
        return re.sub(r"{(\w+):[^}]*}", r"{\1}", self.path)


class SessionCaller(Protocol):
    """A web console session calling a route in process (``api.ui.live``)."""

    async def still_valid(self) -> bool:
        """Whether the session still stands (logout, expiry, its token revoked)."""
        ...

    def forward_headers(self, owner_url: str) -> dict[str, str]:
        """Headers that carry this session to another instance of the fleet at ``owner_url``
        (the request is sent to the same path there: the console's own route)."""
        ...


@dataclass
class ApiRequest:
    raw: web.Request
    ctx: AppContext
    principal: Principal | None
    body: Any = None
    query: Any = None
    params: dict[str, str] = field(default_factory=dict)
    #: The version an ``If-Match`` header names (None: no header, or ``*``).
    if_match: int | None = None
    #: Set when the web console (``api.ui``) calls the route in process for a session, which
    #: holds no bearer token: how a long-lived route re-checks that caller and forwards it.
    session: SessionCaller | None = None
    #: An agent token's first use (``Principal.first_use``) is on record: a write of this
    #: request committed it, or the router did after the handler (``_settle_first_use``).
    first_use_recorded: bool = False

    @property
    def actor(self) -> str:
        return self.principal.actor if self.principal else "anonymous"

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``store.run(fn, *args)``; if this request is its agent token's first use, that is
        stamped in the same pass, not one of its own: as the last write of ``fn``'s first
        commit, or in a commit after ``fn`` when it only read."""
        return await self.ctx.store.run(self._recording_first_use(fn), *args)

    async def write(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a store write (as ``run``) and wake live event streams (every write records
        events)."""
        try:
            return await self.run(fn, *args)
        finally:
            self.ctx.bus.notify()

    def _recording_first_use(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        p = self.principal
        if p is None or not p.first_use or self.first_use_recorded:
            return fn

        def call(s: Any, *args: Any) -> Any:
            stamped: list[bool] = []

            def stamp(session: Any) -> None:
                if not stamped:
                    stamped.append(True)
                    session.flush()  # fn's pending rows first: the stamp is the last write
                    record_first_use(session, p.token_id)

            # In fn's first commit, as its last statement: the token's row is locked after
            # whatever fn locked (a transition revokes a machine's tokens after locking the
            # machine: the same order, so no deadlock on PostgreSQL).
            event.listen(s, "before_commit", stamp)
            try:
                out = fn(s, *args)
                if not stamped:  # fn only read
                    stamp(s)
                    s.commit()
            finally:
                event.remove(s, "before_commit", stamp)
            self.first_use_recorded = True
            return out

        return call

    def page_limit(self, query: Any) -> int:
        """The page size a list call asked for (``limit``), else the configured api.page_size."""
        return query.limit if query.limit is not None else self.ctx.cfg.api.page_size

    def expected_version(self, body_version: int | None) -> int | None:
        """The version the write is conditional on: ``If-Match``'s, else the body's
        ``version``; both given and different can never both hold, so that is a 412."""
        if self.if_match is not None and body_version is not None and body_version != self.if_match:
            raise _Problem(
                412,
                "Precondition failed",
                f"If-Match names version {self.if_match} but the body's version is "
                f"{body_version}; send one of them",
            )
        return self.if_match if self.if_match is not None else body_version

    def next_link(self, cursor: str | None) -> str | None:
        """The ``next`` link of a list answer whose next page starts at ``cursor``."""
        return next_link(self.raw.path, self.raw.query, cursor)

    def require_principal(self) -> Principal:
        assert self.principal is not None
        return self.principal


class Router:
    def __init__(self) -> None:
        self.specs: list[RouteSpec] = []

    def route(
        self,
        method: str,
        path: str,
        *,
        summary: str,
        roles: Iterable[Role] | None,
        body: type[BaseModel] | None = None,
        query: type[BaseModel] | None = None,
        response: type[BaseModel] | None = None,
        status: int = 200,
        tag: str = "",
        raw_response: str | None = None,
        errors: tuple[int, ...] = (),
        raw_body: bool = False,
        max_body: int | None = None,
        location: str | None = None,
        versioned: bool = False,
        use_case: Callable[[ApiRequest], Any] | None = None,
        owner: Owner | None = None,
    ) -> Callable[[Any], Any]:
        def deco(fn: Any) -> Any:
            handler = fn if use_case is None else _with_use_case(fn, use_case)
            if owner is not None:
                handler = _on_owner(handler, owner, response, status, max_body)
            self.specs.append(
                RouteSpec(
                    method=method.upper(),
                    path=path,
                    handler=handler,
                    summary=summary,
                    roles=frozenset(roles) if roles is not None else None,
                    body=body,
                    query=query,
                    response=response,
                    status=status,
                    tag=tag,
                    description=(fn.__doc__ or "").strip(),
                    raw_response=raw_response,
                    errors=errors,
                    raw_body=raw_body,
                    max_body=max_body,
                    location=location,
                    versioned=versioned,
                    use_case=use_case,
                    owner=owner,
                )
            )
            return fn

        return deco


def _with_use_case(
    fn: Callable[[ApiRequest, Any], Awaitable[Any]], use_case: Callable[[ApiRequest], Any]
) -> Handler:
    """The handler of a route declared with ``use_case``: ``fn(req, use_case(req))``."""

    @functools.wraps(fn)
    async def handler(req: ApiRequest) -> Any:
        return await fn(req, use_case(req))

    return handler


def _on_owner(
    fn: Handler,
    owner: Owner,
    response: type[BaseModel] | None,
    status: int,
    max_frame: int | None,
) -> Handler:
    """The handler of a route declared with ``owner``: ``fn`` where this instance owns the
    route's BMC (or was sent the request by the instance that does), else the owner's answer.
    The API and the web console (``api.ui.dispatch``) both call this, so neither forwards by
    hand."""

    @functools.wraps(fn)
    async def handler(req: ApiRequest) -> Any:
        url = await owner_url(req, owner)
        if url is None:
            return await fn(req)
        headers = forward_auth.sign(
            req.ctx.secrets, req.raw.method, req.raw.path_qs, req.ctx.instance
        )
        if owner is Owner.CONSOLE:
            if req.session is not None:  # the web console's session holds no bearer token
                headers |= req.session.forward_headers(url)
            elif auth := req.raw.headers.get("Authorization"):
                headers["Authorization"] = auth
            return await forwarding.proxy_websocket(
                req.raw, url, headers, max_msg_size=max_frame or 4 * 1024 * 1024
            )
        if auth := req.raw.headers.get("Authorization"):
            headers["Authorization"] = auth
        body = req.body.model_dump(mode="json") if isinstance(req.body, BaseModel) else None
        answered, data = await forwarding.forward(req.raw, url, headers, body)
        out = response.model_validate(data) if response is not None else data
        if answered == status:
            return out
        # Another success than the declared one (202: a command still pending there).
        shown = out.model_dump(mode="json") if isinstance(out, BaseModel) else out
        return web.json_response(shown, status=answered)

    return handler


async def owner_url(req: ApiRequest, owner: Owner) -> str | None:
    """The API URL of the instance that owns the BMC ``req``'s path names, when the request
    must go there; None: run it here (this instance owns it, there is no fleet, or another
    instance sent it here: a forwarded request is never forwarded again, and its mark must
    verify, else 403 and nothing runs)."""
    if owner is Owner.CONSOLE and not web.WebSocketResponse().can_prepare(req.raw).ok:
        return None
    if forward_auth.verify(req.ctx.secrets, req.raw.method, req.raw.path_qs, req.raw.headers):
        return None
    bmc = req.ctx.services.bmc
    if bmc is None:
        raise ServiceUnavailable("BMC control is not running in this metald instance")
    if owner is Owner.BMC:
        return await bmc.owner_url(bmc_id=req.params["id"])
    return await bmc.owner_url(machine_id=req.params["id"])


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


async def _principal(request: web.Request, ctx: AppContext) -> Principal | None:
    """The caller, from a read aside the store's writes (``Store.read_aside``): looking up a
    token never queues behind them (an agent token's first use is written by the request: ``ApiRequest``)."""
    secret = bearer_token(request)
    if secret is None:
        return None
    return await principal_of(ctx.store, secret)


async def _settle_first_use(
    ctx: AppContext, principal: Principal | None, areq: ApiRequest | None
) -> None:
    """Record the agent token's first use if no write of the request did (a read-only
    handler, a refusal, an error): every request an agent token makes counts as its use."""
    if principal is None or not principal.first_use:
        return
    if areq is not None and areq.first_use_recorded:
        return
    await record_use(ctx.store, principal.token_id)
    if areq is not None:
        areq.first_use_recorded = True


#: A request body must arrive whole within this many seconds (a trickled body holds a socket).
BODY_TIMEOUT_S = 60.0
#: JSON the API accepts: nested at most this deep, integers within a signed 64-bit column
#: (``api.paging.INT64_MIN``/``INT64_MAX``).
MAX_JSON_DEPTH = 64
#: PostgreSQL text cannot hold NUL, and no name, id or label needs one.
_NUL = "NUL characters (\\u0000) are not allowed"


async def read_body_bytes(
    stream: StreamReader, limit: int, timeout: float = BODY_TIMEOUT_S
) -> bytes:
    """The whole request body, read until its end (not just what is buffered yet), refused
    with 413 as soon as it passes ``limit`` so an endless body costs at most ``limit`` bytes,
    and with 408 when it has not all arrived within ``timeout`` seconds."""
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            while chunk := await stream.readany():
                size += len(chunk)
                if size > limit:
                    raise _Problem(
                        413,
                        "Request body too large",
                        f"the body is larger than the limit of {limit} bytes; send less",
                    )
                chunks.append(chunk)
    except TimeoutError:
        raise _Problem(
            408,
            "Request timeout",
            f"the body did not arrive within {timeout:g} s; send it again, without pauses",
        ) from None
    except (RequestPayloadError, ConnectionResetError) as e:
        raise _Problem(
            400, "Malformed body", f"the body could not be read to its end ({e}); send it again"
        ) from None
    return b"".join(chunks)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a request body into a JSON object, refusing what the store or a response could
    not hold: NaN/Infinity, nesting deeper than MAX_JSON_DEPTH, integers beyond 64 bits."""
    try:
        data = json.loads(raw or b"null", parse_constant=_refuse_constant)
    except RecursionError:
        raise _Problem(
            400, "Malformed JSON", f"the body is nested more than {MAX_JSON_DEPTH} levels deep"
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise _Problem(400, "Malformed JSON", f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise _Problem(400, "Malformed JSON", "the body must be a JSON object")
    check_json_values(data)
    return data


def check_json_values(data: Any, where: str = "") -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and integers outside int64 (iteratively, so
    a deep document cannot exhaust the stack here either). A first pass without paths
    (``_json_values_ok``) accepts the common, clean body; only a body it cannot vouch for is
    walked again with paths, which finds and words the problem."""
    if _json_values_ok(data):
        return
    stack: list[tuple[Any, str, int]] = [(data, where, 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, dict):
            if any("\x00" in str(k) for k in node):
                raise _Problem(422, "Invalid request", f"{path or '(body)'}: a key: {_NUL}")
            children: Iterable[tuple[str, Any]] = ((str(k), v) for k, v in node.items())
        elif isinstance(node, list):
            children = ((str(i), v) for i, v in enumerate(node))
        else:
            if isinstance(node, str) and "\x00" in node:
                raise _Problem(422, "Invalid request", f"{path or '(body)'}: {_NUL}")
            is_int = isinstance(node, int) and not isinstance(node, bool)
            if is_int and not INT64_MIN <= node <= INT64_MAX:
                raise _Problem(
                    422,
                    "Invalid request",
                    f"{path or '(body)'}: the integer does not fit in 64 bits "
                    f"(the largest allowed is {INT64_MAX})",
                )
            continue
        if depth >= MAX_JSON_DEPTH:
            raise _Problem(
                400, "Malformed JSON", f"the body is nested more than {MAX_JSON_DEPTH} levels deep"
            )
        stack.extend((v, f"{path}.{k}" if path else k, depth + 1) for k, v in children)


def _json_values_ok(data: Any) -> bool:
    """True only if ``check_json_values`` would accept ``data``: the same rules (no NUL in a
    key or string, integers within int64, containers at most MAX_JSON_DEPTH deep), without
    building a path per value (a 6 KB inventory has ~600 values). False for anything it does
    not know for sure (a type other than JSON's own): the caller then walks with paths."""
    stack: list[tuple[Any, int]] = [(data, 0)]
    pop, push = stack.pop, stack.append
    lo, hi = INT64_MIN, INT64_MAX
    while stack:
        node, depth = pop()
        t = type(node)
        if t is dict:
            if depth >= MAX_JSON_DEPTH:
                return False
            for k in node:
                if type(k) is not str or "\x00" in k:
                    return False
            values: Iterable[Any] = node.values()
        elif t is list:
            if depth >= MAX_JSON_DEPTH:
                return False
            values = node
        else:
            values = (node,)
            depth -= 1  # a scalar root: checked below as a value
        for v in values:
            t = type(v)
            if t is str:
                if "\x00" in v:
                    return False
            elif t is int:
                if not lo <= v <= hi:
                    return False
            elif t is dict or t is list:
                push((v, depth + 1))
            elif not (t is float or t is bool or v is None):
                return False
    return True


async def _read_body(request: web.Request, spec: RouteSpec, limit: int) -> Any:
    assert spec.body is not None
    if request.content_length is not None and request.content_length > limit:
        raise _Problem(
            413,
            "Request body too large",
            f"the body is {request.content_length} bytes; the limit is {limit}",
        )
    ctype = request.content_type
    if ctype not in ("application/json", "application/merge-patch+json"):
        raise _Problem(
            415,
            "Unsupported media type",
            f"send the body as application/json (got {ctype or 'nothing'})",
        )
    data = parse_json_object(await read_body_bytes(request.content, limit))
    return data if spec.raw_body else spec.body.model_validate(data)


def check_path(params: Mapping[str, str]) -> None:
    """Refuse a path whose parameters (ids, names) hold NUL: 404, as no resource has one."""
    if any("\x00" in v for v in params.values()):
        raise _Problem(404, "Not found", f"there is no resource at this path ({_NUL})")


def check_query(query: MultiMapping[str]) -> None:
    """Refuse query parameters (names or values) that hold NUL: 422."""
    for key in query:
        if "\x00" in key or any("\x00" in v for v in query.getall(key)):
            raise _Problem(422, "Invalid request", f"query parameter {key[:64]!r}: {_NUL}")


def check_inputs(request: web.Request) -> None:
    """The text inputs of a request (path parameters, query) checked once, the same way for
    the API (``make_handler``) and the web console (``api.ui.guard``): what PostgreSQL cannot
    hold (NUL) is a 4xx here, never a driver error."""
    check_path(request.match_info)
    check_query(request.query)


def validate_query(model: type[BaseModel], data: Mapping[str, Any]) -> Any:
    """A route's query model from ``data`` (a request's parameters, or the console's own), with
    what the store cannot hold refused first (NUL) and after (integers beyond 64 bits: they
    reach SQL as parameters)."""
    check_json_values(dict(data))
    query = model.model_validate(data)
    check_json_values(query.model_dump(mode="json"))
    return query


def _query(request: web.Request, spec: RouteSpec) -> Any:
    assert spec.query is not None
    check_query(request.query)
    data: dict[str, Any] = {}
    for key in request.query:
        values = request.query.getall(key)
        fld = spec.query.model_fields.get(key)
        is_list = fld is not None and "list" in str(fld.annotation)
        data[key] = values if is_list else values[-1]
    return validate_query(spec.query, data)


def etag(version: int) -> str:
    """The strong entity tag of a versioned resource: its version column, quoted."""
    return f'"{version}"'


def parse_if_match(spec: RouteSpec, header: str | None) -> int | None:
    """The version ``If-Match`` names: None when absent or ``*`` (any current version). A
    route that writes no versioned row cannot meet a specific tag, so that is a 412 (RFC 9110
    13.1.1), as is a list of several tags (one row has one version)."""
    if header is None or header.strip() == "*":
        return None
    if not spec.versioned:
        raise _Problem(
            412,
            "Precondition failed",
            "this resource carries no version, so If-Match cannot hold; send the request "
            "without it",
        )
    tags = [t.strip() for t in header.split(",") if t.strip()]
    m = re.fullmatch(r'"(\d{1,18})"', tags[0]) if len(tags) == 1 else None
    if m is None:
        raise _Problem(
            412,
            "Precondition failed",
            f'If-Match must be the one ETag a GET of this resource answered, like "3" '
            f"(got {header[:80]!r})",
        )
    return int(m.group(1))


class _Problem(Exception):
    def __init__(self, status: int, title: str, detail: str) -> None:
        self.status, self.title, self.detail = status, title, detail


def _serialize(spec: RouteSpec, result: Any, params: dict[str, str]) -> web.StreamResponse:
    """The handler's result as the response its declaration documents: the declared status
    (a route that answers nothing declares 204, so the document and the wire agree) and, for a
    route that creates, the new resource's ``Location``."""
    if isinstance(result, web.StreamResponse):
        return result
    if result is None:
        if spec.status != 204:
            raise RuntimeError(
                f"{spec.method} {spec.path} answered nothing but declares {spec.status}"
            )
        return web.Response(status=204)
    if spec.status == 204:
        raise RuntimeError(f"{spec.method} {spec.path} declares 204 but answered a body")
    payload = result.model_dump() if isinstance(result, BaseModel) else result
    headers = {}
    if isinstance(payload, dict) and isinstance(payload.get("version"), int) and "id" in payload:
        headers["ETag"] = etag(payload["version"])
    if spec.location is not None:
        headers["Location"] = spec.location.format(**{**params, **payload})
    return web.json_response(
        wire_json(payload),
        status=spec.status,
        headers=headers,
        dumps=lambda o: json.dumps(o, default=str),
    )


def wire_json(value: Any) -> Any:
    """``value`` as the JSON-ready data every answer and event stream sends (timestamps with
    their UTC offset)."""
    return to_jsonable_python(_utc(value))


def _utc(value: Any) -> Any:
    """Naive datetimes (SQLite stores timestamps without their zone; metald writes UTC) as
    UTC, so every timestamp the API sends is an RFC 3339 date-time with its offset."""
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    if isinstance(value, dict):
        return {k: _utc(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_utc(v) for v in value]
    return value


def authorize(spec: RouteSpec, principal: Principal | None) -> Principal | None:
    """The caller, if the route lets it in: 401 without a principal, 403 for a role the route
    does not name. The API and the web console (``api.ui``) both decide with this."""
    if spec.roles is None:
        return principal
    if principal is None:
        raise _Problem(
            401, "Unauthorized", "send a valid, unexpired token as 'Authorization: Bearer <token>'"
        )
    if principal.role not in spec.roles:
        allowed = ", ".join(sorted(r.value for r in spec.roles))
        raise _Problem(
            403,
            "Forbidden",
            f"{_article(principal.role.value)} {principal.role.value} token cannot "
            f"{spec.summary.lower()}; this needs one of: {allowed}",
        )
    return principal


#: A refusal raised before a handler runs (authorisation, body, query): status, title, detail.
Refusal = _Problem


def make_handler(
    spec: RouteSpec, ctx: AppContext
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    kinds = path_kinds(spec.path)

    async def handle(request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        status = 500
        principal: Principal | None = None
        areq: ApiRequest | None = None
        try:
            if spec.roles is not None:
                principal = await _principal(request, ctx)
                authorize(spec, principal)
            check_path(request.match_info)
            # A name or an id prefix: the same rules on every route.
            params = await resolve_params(ctx.store, principal, kinds, dict(request.match_info))
            areq = ApiRequest(request, ctx, principal, params=params)
            if request.method not in ("GET", "HEAD"):
                areq.if_match = parse_if_match(spec, request.headers.get("If-Match"))
            if spec.query is not None:
                areq.query = _query(request, spec)
            elif request.query:  # a misspelt filter must not silently list everything
                name = next(iter(request.query))
                raise _Problem(
                    422,
                    "Invalid request",
                    f"unknown query parameter {name[:64]!r}: this operation takes none",
                )
            if spec.body is not None:
                areq.body = await _read_body(
                    request, spec, spec.max_body or ctx.cfg.api.max_body_bytes
                )
            areq.query, areq.body = await resolve_refs_of(ctx.store, principal, areq)
            resp = _serialize(spec, await spec.handler(areq), areq.params)
        except _Problem as p:
            resp = problem(p.status, p.title, p.detail, instance=request.path)
        except ValidationError as e:
            resp = validation_problem(e, instance=request.path)
        except ConcurrentUpdate as e:
            if request.headers.get("If-Match", "*").strip() != "*":
                # The write was conditional on the header's version: RFC 9110 13.1.1.
                resp = problem(412, "Precondition failed", e.detail, instance=request.path)
            else:
                resp = problem(e.status, e.title, e.detail, instance=request.path, **e.extra)
        except MetaldError as e:
            resp = problem(e.status, e.title, e.detail, instance=request.path, **e.extra)
        finally:
            # Whatever the answer (a refusal included), an agent token presented is a used one.
            await _settle_first_use(ctx, principal, areq)
        status = resp.status
        metrics.api_requests.labels(spec.method, spec.openapi_path, str(status)).inc()
        metrics.api_latency.labels(spec.method, spec.openapi_path).observe(
            time.perf_counter() - started
        )
        return resp

    return handle


def add_routes(app: web.Application, router: Router, ctx: AppContext) -> None:
    for spec in router.specs:
        app.router.add_route(spec.method, spec.path, make_handler(spec, ctx))
