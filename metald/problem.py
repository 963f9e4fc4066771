"""RFC 9457 problem details: every error metald answers over HTTP (the API and the boot
plane's HTTP routes) is one of these. The API's validation problems are in ``api.problem``."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

PROBLEM_TYPE = "application/problem+json"
_TYPES = {
    400: "bad-request",
    401: "unauthorized",
    403: "forbidden",
    404: "not-found",
    405: "method-not-allowed",
    408: "request-timeout",
    409: "conflict",
    413: "payload-too-large",
    415: "unsupported-media-type",
    422: "unprocessable",
    429: "too-many-requests",
    500: "internal-error",
    502: "upstream-error",
    503: "unavailable",
}


def problem(
    status: int, title: str, detail: str, *, instance: str | None = None, **extra: Any
) -> web.Response:
    body: dict[str, Any] = {
        "type": f"https://metald.dev/problems/{_TYPES.get(status, 'error')}",
        "title": title,
        "status": status,
        "detail": detail,
    }
    if instance:
        body["instance"] = instance
    body.update(extra)
    headers = {"WWW-Authenticate": 'Bearer realm="metald"'} if status == 401 else {}
    if "retry_after_s" in extra:
        headers["Retry-After"] = str(extra["retry_after_s"])
    return web.Response(
        status=status,
        text=json.dumps(body, default=str),
        content_type=PROBLEM_TYPE,
        headers=headers,
    )
