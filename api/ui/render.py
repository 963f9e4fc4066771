"""HTML out: the Jinja2 environment (autoescaping on), pages, and errors as the API's
problem details (the same title and sentence; problem+json for scripts that ask for JSON)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

from api.problem import problem
from metald.units import disk_size, mib

TEMPLATES = Path(__file__).parent / "templates"

_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES),
    autoescape=True,
    trim_blocks=True,
    lstrip_blocks=True,
)


def _ago(value: Any) -> str:
    """A timestamp as how long ago it was ('3m', '2h 5m', '4d')."""
    if not value:
        return ""
    ts = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=UTC)
    secs = int((datetime.now(UTC) - ts).total_seconds())
    if secs < 60:
        return f"{max(secs, 0)}s"
    if secs < 3600:
        return f"{secs // 60}m"
    if secs < 86400:
        return f"{secs // 3600}h {secs % 3600 // 60}m"
    return f"{secs // 86400}d"


def _iso(value: Any) -> str:
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()
    return str(value or "")


_env.filters["ago"] = _ago
_env.filters["iso"] = _iso
_env.filters["disk"] = disk_size
_env.filters["mib"] = mib

#: Every page: no framing (clickjacking), scripts and styles only from /ui/static, no caching
#: of pages that show the fleet.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def fragment(template: str, **context: Any) -> str:
    return _env.get_template(template).render(**context)


def page(template: str, *, status: int = 200, **context: Any) -> web.Response:
    return web.Response(
        text=fragment(template, **context),
        status=status,
        content_type="text/html",
        charset="utf-8",
        headers=SECURITY_HEADERS,
    )


def wants_json(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    return "application/json" in accept or "application/problem+json" in accept


def error(
    request: web.Request, status: int, title: str, detail: str, **context: Any
) -> web.Response:
    """A refusal: problem+json to a script that asked for JSON, else an error page with the
    same sentence."""
    if wants_json(request):
        return problem(status, title, detail, instance=request.path)
    return page(
        "error.html",
        status=status,
        title=title,
        problem={"status": status, "title": title, "detail": detail, "instance": request.path},
        **{"me": None, "csrf": "", "nav": "", **context},
    )
