"""Use cases: what the API asks of the domain, one module per resource.

Each use case owns its transaction (one ``Store.run``/``Store.read`` per call) and its
after-commit effects (waking the event streams, a tenant hub's peers, the mesh watch), the way
``metald.claims.workflow`` does for claims. The API authorises, validates and declares; it
hands a use case the caller (a ``Principal``) and plain values, and gets back plain data (the
``*_view`` dicts its response models validate) or a page of them (``metald.usecases.reads``).
Services a use case needs are passed in as parameters (typed by a Protocol where they live
elsewhere), never looked up by name here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

#: What an id looks like (a UUID): a name of that shape would be read as an id by every path
#: that takes either, so no name may have it.
ID_SHAPED = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

T = TypeVar("T")


class Writes(Protocol):
    """Where a use case runs a write transaction: ``metald.store.Store``, or the API request
    (``api.routing.ApiRequest.run``: it stamps an agent token's first use in the same
    commit)."""

    async def run(self, fn: Callable[..., T], *args: Any) -> T: ...


class Transactions(Writes, Protocol):
    """Where a use case runs its transactions: ``metald.store.Store`` (``run`` writes, ``read``
    is a read-only transaction)."""

    async def read(self, fn: Callable[..., T], *args: Any) -> T: ...


def nothing() -> None:
    """A ``notify`` that wakes nobody (no event bus: tests, tools)."""
