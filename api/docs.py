"""Render docs/api.md from the route declarations: ``python -m api.docs > docs/api.md``."""

from __future__ import annotations

import sys

from api.app import ROUTERS, all_specs


def render() -> str:
    lines = [
        "# metald HTTP API",
        "",
        "Generated from the route declarations by `python -m api.docs` (a test checks it is",
        "current). The machine-readable version is `GET /api/v1/openapi.json`. Authenticate with",
        "`Authorization: Bearer <token>`; errors are RFC 9457 `application/problem+json`.",
        "",
        "| method | path | summary | roles | body | response |",
        "|---|---|---|---|---|---|",
    ]
    for s in sorted(all_specs(ROUTERS), key=lambda s: (s.openapi_path, s.method)):
        roles = "no token" if s.roles is None else ", ".join(sorted(r.value for r in s.roles))
        body = s.body.__name__ if s.body else ""
        resp = s.response.__name__ if s.response else (s.raw_response or "")
        lines.append(
            f"| {s.method} | `{s.openapi_path}` | {s.summary} | {roles} | {body} | {resp} |"
        )
    lines += ["", "## Details", ""]
    for s in sorted(all_specs(ROUTERS), key=lambda s: (s.openapi_path, s.method)):
        lines.append(f"### {s.method} `{s.openapi_path}`")
        lines.append("")
        lines.append(s.description or s.summary)
        if s.query is not None:
            lines.append("")
            lines.append("Query: " + ", ".join(f"`{k}`" for k in s.query.model_fields))
        if s.body is not None:
            lines.append("")
            fields = ", ".join(
                f"`{k}`" + ("" if f.is_required() else "?") for k, f in s.body.model_fields.items()
            )
            lines.append(f"Body ({s.body.__name__}): {fields}")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
