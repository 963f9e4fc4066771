"""What the synchronous and asynchronous clients share: errors, pages, the settle rule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from metald.lifecycle import SETTLED

Query = list[tuple[str, str]]
Json = dict[str, Any]


class ApiError(Exception):
    """The API answered an error status; ``body`` is its RFC 9457 problem document."""

    def __init__(self, status: int, body: Json) -> None:
        super().__init__(body.get("detail") or body.get("title") or f"HTTP {status}")
        self.status = status
        self.body = body

    @property
    def detail(self) -> str:
        return str(self.body.get("detail") or self.body.get("title") or f"HTTP {self.status}")


class PreconditionFailed(ApiError):
    """412: the resource changed since the ETag sent as If-Match was read."""


def error_for(status: int, body: Json) -> ApiError:
    return (PreconditionFailed if status == 412 else ApiError)(status, body)


@dataclass
class Page:
    """One page of a list: its items, the total, and the path of the next page (or None)."""

    items: list[Json]
    total: int
    next: str | None = None
    raw: Json = field(default_factory=dict)

    @classmethod
    def of(cls, body: Json) -> Page:
        return cls(items=body["items"], total=body["total"], next=body.get("next"), raw=body)


def with_query(path: str, query: Query | None) -> str:
    return f"{path}?{urlencode(query)}" if query else path


def headers(
    token: str | None, *, if_match: str | None = None, body: bool = False
) -> dict[str, str]:
    out = {"Accept": "application/json"}
    if token:
        out["Authorization"] = f"Bearer {token}"
    if if_match is not None:
        out["If-Match"] = if_match
    if body:
        out["Content-Type"] = "application/json"
    return out


def claim_settled(claim: Json) -> bool:
    """Every machine of the claim is where it stays without anyone acting: active,
    provisioned, or failed (a failed one needs a person; waiting longer will not help)."""
    return claim.get("state") == "released" or all(
        m.get("state") in {s.value for s in SETTLED} for m in claim.get("machines", [])
    )


def claim_body(
    tenant: str,
    count: int,
    image: str,
    *,
    selector: Json | None = None,
    ssh_keys: list[str] | None = None,
    idempotency_key: str | None = None,
    os: Json | None = None,
) -> Json:
    """``os``: the tenant's OS fields (``user_data``, ``meta_data``, ``network``, ``storage``;
    docs/tenant-os.md), passed as given."""
    body: Json = {"tenant_id": tenant, "count": count, "image_id": image, **(os or {})}
    if selector:
        body["selector"] = selector
    if ssh_keys:
        body["ssh_authorized_keys"] = ssh_keys
    if idempotency_key:
        body["idempotency_key"] = idempotency_key
    return body


def repair_body(machine: str, summary: str, part: str | None) -> Json:
    body: Json = {"machine": machine, "summary": summary}
    if part:
        body["part"] = part
    return body
