"""RFC 9457 problem details: every error metald answers over HTTP (the API and the boot
plane's HTTP routes) is one of these. The API's validation problems are in ``api.problem``."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

PROBLEM_TYPE = "application/problem+json"


def problem(
    status: int, title: str, detail: str, *, instance: str | None = None, **extra: Any
) -> web.Response:
    body: dict[str, Any] = {
        # RFC 9457 4.2.1: the problem carries no meaning beyond its status code (the sentence
        # is in detail), so its type is about:blank, not a URI that would resolve to nothing.
        "type": "about:blank",
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
