"""What a reference in a path names: a full id, a name (machines, tenants, images), or a unique
id prefix of at least 8 characters, among the rows the caller's token can see (so names and
prefixes reveal nothing a scoped token could not list). ``api.resolve`` runs it for every
``{id}`` of every route before any handler."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlmodel import Session, col, or_, select

from metald.auth import Principal, Role
from metald.errors import Conflict, NotFound, Unprocessable
from metald.store.models import Bmc, Claim, Image, Machine, Repair, Tenant
from metald.usecases import ID_SHAPED, Transactions, Writes

#: Shortest id prefix accepted (8 hex digits of a UUID: one in four billion per pair).
MIN_PREFIX = 8
#: Most matches an ambiguous reference lists.
MAX_LISTED = 10
_ID_CHARS = re.compile(r"[0-9a-f-]+")

_STAFF = (Role.ADMIN, Role.TECHNICIAN)


@dataclass(frozen=True)
class Kind:
    model: Any
    #: The unique column a reference may name, if the resource has one.
    name: str | None
    #: Whether a non-staff caller may see this row (staff see all).
    visible: Callable[[Principal, Any], bool]


KINDS: dict[str, Kind] = {
    "machines": Kind(Machine, "name", lambda p, m: p.can_see_machine(m.id, m.tenant_id)),
    "tenants": Kind(Tenant, "name", lambda p, t: p.can_see_tenant(t.id)),
    "images": Kind(
        Image,
        "name",
        lambda p, i: (
            p.role is Role.ORCHESTRATOR
            and (not i.tenants or any(p.can_see_tenant(t) for t in i.tenants))
        ),
    ),
    "claims": Kind(Claim, None, lambda p, c: p.can_see_tenant(c.tenant_id)),
    "bmcs": Kind(Bmc, None, lambda p, b: False),
    #: The repair queue is staff business: no scoped token resolves a repair.
    "repairs": Kind(Repair, None, lambda p, r: False),
}


def resolve(session: Session, principal: Principal | None, kind: str, ref: str) -> str:
    """The id ``ref`` names among the ``kind`` rows the caller may see: itself when it is an
    id, else the row with that name, else the one row whose id starts with it (8+ characters).
    Several matches: 409 listing them. None: ``ref`` unchanged, for the route's own 404."""
    if ID_SHAPED.fullmatch(ref):
        return ref
    k = KINDS[kind]
    model = k.model

    def may_see(row: Any) -> bool:
        if principal is None:
            return False
        return principal.role in _STAFF or k.visible(principal, row)

    row = session.get(model, ref)
    if row is not None:
        return ref
    if principal is None:
        return ref
    clauses = []
    if k.name is not None:
        clauses.append(getattr(model, k.name) == ref)
    by_prefix = len(ref) >= MIN_PREFIX and _ID_CHARS.fullmatch(ref) is not None
    if by_prefix:  # hex digits and dashes only: no LIKE wildcard can reach the pattern
        clauses.append(col(model.id).startswith(ref))
    if not clauses:
        return ref
    rows = [r for r in session.exec(select(model).where(or_(*clauses)).limit(200)) if may_see(r)]
    if k.name is not None:
        named = [r for r in rows if getattr(r, k.name) == ref]
        if named:
            return str(named[0].id)
    if len(rows) == 1:
        return str(rows[0].id)
    if len(rows) > 1:
        listed = sorted(str(r.id) for r in rows)[:MAX_LISTED]
        raise Conflict(
            f"{ref!r} matches {len(rows)} {kind}; use more of the id or the full id",
            matches=listed,
        )
    if len(ref) < MIN_PREFIX and _ID_CHARS.fullmatch(ref) is not None:
        what = kind[:-1]
        lead = f"no {what} named {ref!r}, and" if k.name is not None else f"{ref!r}:"
        raise NotFound(
            f"{lead} an id prefix needs at least {MIN_PREFIX} characters; "
            f"use more of the {what}'s id" + (" or its name" if k.name is not None else "")
        )
    return ref


async def resolve_all(
    store: Transactions, principal: Principal | None, wanted: dict[str, tuple[str, Any]]
) -> dict[str, Any]:
    """Several references at once, in one read: ``{field: (kind, ref or list of refs)}`` to
    ``{field: id or list of ids}`` for the fields whose value changes (``resolve`` for each;
    a too-short prefix is a 422 naming the field, as any invalid field of a request)."""

    def one(s: Session, field: str, kind: str, ref: str) -> str:
        if ID_SHAPED.fullmatch(ref):
            return ref
        try:
            return resolve(s, principal, kind, ref)
        except NotFound as e:  # a too-short prefix: in a request's fields, an invalid value
            raise Unprocessable(f"{field}: {e.detail}") from None

    def run(s: Session) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for field, (kind, v) in wanted.items():
            new: Any = (
                [one(s, field, kind, r) for r in v]
                if isinstance(v, list)
                else one(s, field, kind, v)
            )
            if new != v:
                out[field] = new
        return out

    if not any(
        not ID_SHAPED.fullmatch(r)
        for _kind, v in wanted.values()
        for r in (v if isinstance(v, list) else [v])
    ):
        return {}
    return await store.read(run)


async def resolve_params(
    store: Writes, principal: Principal | None, kinds: dict[str, str], params: dict[str, str]
) -> dict[str, str]:
    """``params`` (a path's parameters) with each reference to a resource (``kinds``: which
    parameter names which kind) that is not an id already replaced by the id it names
    (``resolve``), all in one transaction; none to resolve, none opened."""
    refs = {n: kind for n, kind in kinds.items() if not ID_SHAPED.fullmatch(params.get(n, ""))}
    if not refs:
        return dict(params)
    ids = await store.run(
        lambda s: {n: resolve(s, principal, kind, params[n]) for n, kind in refs.items()}
    )
    return {**params, **ids}
