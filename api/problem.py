"""RFC 9457 problem details: every error the API returns is one of these."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from pydantic import ValidationError

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


def describe_validation(e: ValidationError) -> tuple[str, list[dict[str, Any]]]:
    errors = []
    for err in e.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(body)"
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] == "missing":
            msg = "is required"
        else:
            msg = err["msg"]
        errors.append({"field": field, "message": msg})
    sentence = "; ".join(f"{x['field']}: {x['message']}" for x in errors)
    return sentence, errors


def validation_problem(e: ValidationError, *, instance: str | None = None) -> web.Response:
    sentence, errors = describe_validation(e)
    return problem(
        422,
        "Invalid request",
        f"the request does not validate: {sentence}",
        instance=instance,
        errors=errors,
    )
