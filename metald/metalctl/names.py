"""Names where the API answers with ids: tables show a machine's or a tenant's name (its
8-character id prefix, itself a valid reference, when it has none or is not visible)."""

from __future__ import annotations

from collections.abc import Iterable

from .client import ApiError, Client


def _by_id(c: Client, path: str) -> dict[str, str]:
    try:
        return {r["id"]: r["name"] for r in c.iterate(path) if r.get("name")}
    except ApiError:  # a token that may not list them: ids it is
        return {}


def machine_names(c: Client) -> dict[str, str]:
    """Every visible machine's id to its name."""
    return _by_id(c, "/api/v1/machines")


def tenant_names(c: Client, ids: Iterable[str | None]) -> dict[str, str]:
    """Tenant id to name for ``ids`` (one list call, only when there is any id to name)."""
    wanted = {i for i in ids if i}
    return _by_id(c, "/api/v1/tenants") if wanted else {}


def image_names(c: Client, ids: Iterable[str | None]) -> dict[str, str]:
    """Image id to name for ``ids`` (one list call, only when there is any id to name)."""
    wanted = {i for i in ids if i}
    return _by_id(c, "/api/v1/images") if wanted else {}


def shown(names: dict[str, str], ref: str | None) -> str:
    if not ref:
        return "-"
    return names.get(ref) or ref[:8]
