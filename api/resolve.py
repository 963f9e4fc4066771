"""One resolver for every ``{id}`` in a path: a full id, a name (machines, tenants, images), or
a unique id prefix of at least 8 characters. It runs in the routing layer before any handler,
so every route accepts the same references; what it may match is limited to what the caller's
token can see, so names and prefixes reveal nothing a scoped token could not list. Body and
query fields marked ``Ref(kind)`` take the same references (``resolve_refs``), resolved after
validation and before the handler."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel

from metald.auth import Principal
from metald.usecases import ID_SHAPED
from metald.usecases.names import KINDS, resolve, resolve_all

#: A whole id (names may not have this shape: ``metald.usecases.ID_SHAPED``).
FULL_ID = ID_SHAPED
M = TypeVar("M", bound=BaseModel)


def path_kinds(path: str) -> dict[str, str]:
    """Which resource each path parameter names: the collection segment before it
    (``/claims/{id}/machines/{machine_id}``: id is a claim, machine_id a machine)."""
    out: dict[str, str] = {}
    for m in re.finditer(r"/([a-z-]+)/{(\w+)(?::[^}]*)?}", path):
        if m.group(1) in KINDS:
            out[m.group(2)] = m.group(1)
    return out


@dataclass(frozen=True)
class Ref:
    """Marks a body or query field (or the items of a list field) as a reference to a
    ``kind`` resource: it takes what a path takes (``resolve_refs``), e.g.
    ``tenant_id: Annotated[Text, Ref("tenants")]``."""

    kind: str


def _ref_in(annotation: Any) -> tuple[str, bool] | None:
    """The kind a field's annotation references and whether it is a list of them."""
    if get_origin(annotation) is Annotated:
        for meta in annotation.__metadata__:
            if isinstance(meta, Ref):
                return meta.kind, False
        return _ref_in(get_args(annotation)[0])
    if get_origin(annotation) is list:
        (item,) = get_args(annotation) or (None,)
        found = _ref_in(item)
        return (found[0], True) if found else None
    if get_origin(annotation) in (Union, UnionType):
        for arg in get_args(annotation):
            found = _ref_in(arg)
            if found:
                return found
    return None


@cache
def ref_fields(model: type[BaseModel]) -> dict[str, tuple[str, bool]]:
    """The fields of ``model`` marked with ``Ref``: name -> (kind, is a list)."""
    out: dict[str, tuple[str, bool]] = {}
    for name, field in model.model_fields.items():
        found = next(
            ((m.kind, False) for m in field.metadata if isinstance(m, Ref)), None
        ) or _ref_in(field.annotation)
        if found:
            out[name] = found
    return out


async def resolve_refs(store: Any, principal: Principal | None, value: M) -> M:
    """``value`` (a parsed body or query) with each ``Ref`` field's name or id prefix replaced
    by the id it names, by the rules of a path's ``{id}`` (the caller's visibility, 409 when
    ambiguous, 404 for a too-short prefix). What names nothing is left for the route's 404."""
    wanted = {
        n: (kind, v)
        for n, (kind, _many) in ref_fields(type(value)).items()
        if (v := getattr(value, n, None)) not in (None, [], "")
    }
    if not wanted:
        return value
    update = await resolve_all(store, principal, wanted)
    return value.model_copy(update=update) if update else value


async def resolve_refs_of(store: Any, principal: Principal | None, req: Any) -> tuple[Any, Any]:
    """A request's query and body with their references resolved (``resolve_refs``)."""
    query, body = req.query, req.body
    if isinstance(query, BaseModel):
        query = await resolve_refs(store, principal, query)
    if isinstance(body, BaseModel):
        body = await resolve_refs(store, principal, body)
    return query, body


__all__ = ["FULL_ID", "KINDS", "Ref", "path_kinds", "resolve", "resolve_refs", "resolve_refs_of"]
