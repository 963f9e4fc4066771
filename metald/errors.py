"""Domain errors raised by metald's services; the API maps each to a problem+json status."""

from __future__ import annotations

from typing import Any


class MetaldError(Exception):
    status = 400
    title = "Bad request"

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra


class NotFound(MetaldError):
    status = 404
    title = "Not found"


class Conflict(MetaldError):
    status = 409
    title = "Conflict"


class Unprocessable(MetaldError):
    status = 422
    title = "Unprocessable request"


class Forbidden(MetaldError):
    status = 403
    title = "Forbidden"


class Unauthorized(MetaldError):
    status = 401
    title = "Unauthorized"


class ServiceUnavailable(MetaldError):
    """A service this instance does not run (BMC control, serial consoles)."""

    status = 503
    title = "Service unavailable"
