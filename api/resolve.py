"""One resolver for every ``{id}`` in a path: a full id, a name (machines, tenants, images), or
a unique id prefix of at least 8 characters. It runs in the routing layer before any handler,
so every route accepts the same references; what it may match is limited to what the caller's
token can see, so names and prefixes reveal nothing a scoped token could not list."""

from __future__ import annotations

import re

from metald.usecases import ID_SHAPED
from metald.usecases.names import KINDS, resolve

#: A whole id (names may not have this shape: ``metald.usecases.ID_SHAPED``).
FULL_ID = ID_SHAPED


def path_kinds(path: str) -> dict[str, str]:
    """Which resource each path parameter names: the collection segment before it
    (``/claims/{id}/machines/{machine_id}``: id is a claim, machine_id a machine)."""
    out: dict[str, str] = {}
    for m in re.finditer(r"/([a-z-]+)/{(\w+)(?::[^}]*)?}", path):
        if m.group(1) in KINDS:
            out[m.group(2)] = m.group(1)
    return out


__all__ = ["FULL_ID", "KINDS", "path_kinds", "resolve"]
