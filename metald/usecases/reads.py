"""The paged read model every list of the API goes through.

A list use case builds its filtered statement (or, for a list held in memory, its items) and
hands it to ``page`` or ``page_items`` with the caller's ``Pager``: how many rows, in which
order, after which cursor (``api.paging`` binds one to a request's ``limit``/``cursor``/
``sort``). The answer is a ``Page``: the rows of this page as views, the total the filters
match, and the cursor of the next page (None on the last).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from sqlalchemy import func
from sqlmodel import Session, select

T = TypeVar("T")
V = TypeVar("V")
#: An order: field names, ``-`` for descending, ending with ``id``.
Order = list[str]


class Pager(Protocol):
    """One page of a list in the caller's order and the cursor of the next page."""

    def rows(
        self, session: Session, stmt: Any, model: Any, default: Order
    ) -> tuple[list[Any], str | None]: ...

    def items(
        self, items: list[Any], default: Order, get: Callable[[Any, str], Any]
    ) -> tuple[list[Any], str | None]: ...


@dataclass(frozen=True)
class Page(Generic[V]):
    items: list[V]
    #: How many rows the filters match (all pages).
    total: int
    #: Where the next page starts; None on the last page.
    cursor: str | None


def count(session: Session, stmt: Any) -> int:
    """How many rows ``stmt`` (filters applied, no order) matches."""
    return int(session.exec(select(func.count()).select_from(stmt.subquery())).one())


def page(
    session: Session,
    stmt: Any,
    model: Any,
    pager: Pager,
    default: Order,
    view: Callable[[Session, list[Any]], list[V]],
) -> Page[V]:
    """One page of ``stmt`` (a ``select(model)`` with its filters, no order yet): counted,
    ordered and cut by ``pager``; ``view`` turns the page's rows into what the caller gets
    (all at once, in the same transaction, so it can load what the rows share in one query)."""
    total = count(session, stmt)
    rows, cursor = pager.rows(session, stmt, model, default)
    return Page(view(session, rows), total, cursor)


def page_items(
    items: list[T],
    pager: Pager,
    default: Order,
    view: Callable[[list[T]], list[V]],
    *,
    get: Callable[[Any, str], Any] = getattr,
) -> Page[V]:
    """``page`` for a list already held in memory (filtered by Python, e.g. on a JSON
    column); ``get(item, field)`` reads a sort field (an attribute, unless told)."""
    rows, cursor = pager.items(items, default, get)
    return Page(view(rows), len(items), cursor)
