"""The API's half of the paged read model (``metald.usecases.reads``): a request's paging
(``limit``, ``cursor``, ``sort``, ``offset``: ``api.paging``) as the ``Pager`` a list use case
pages with, and a ``Page`` as the list answer every list endpoint sends (items, total, limit,
offset, the ``next`` link)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from api.paging import PageQuery, page_items, page_rows
from metald.usecases.reads import Order, Page

if TYPE_CHECKING:
    from api.routing import ApiRequest

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Paging:
    """A list call's ``PageQuery`` and page size, as a ``metald.usecases.reads.Pager``."""

    query: PageQuery
    limit: int

    def rows(
        self, session: Any, stmt: Any, model: Any, default: Order
    ) -> tuple[list[Any], str | None]:
        return page_rows(session, stmt, model, self.query, default, self.limit)

    def items(
        self, items: list[Any], default: Order, get: Callable[[Any, str], Any]
    ) -> tuple[list[Any], str | None]:
        return page_items(items, self.query, default, self.limit, get)


def paging(req: ApiRequest) -> Paging:
    """The paging the request asked for (its declared query is a ``PageQuery``)."""
    q: PageQuery = req.query
    return Paging(q, req.page_limit(q))


def answer(model: type[M], page: Page[Any], p: Paging, req: ApiRequest, **extra: Any) -> M:
    """The list answer: this page's items, the total, the link to the next page, and the
    list's ``extra`` fields."""
    return model.model_validate(
        {
            "items": page.items,
            "total": page.total,
            "limit": p.limit,
            "offset": p.query.offset,
            "next": req.next_link(page.cursor),
            **extra,
        }
    )


async def listed(
    req: ApiRequest,
    model: type[M],
    fetch: Callable[[Paging], Awaitable[Page[Any]]],
    **extra: Any,
) -> M:
    """A list endpoint's answer: ``fetch`` (a use case's ``list``, bound to the caller and
    its filters) for the paging the request asked for, as ``answer`` words it."""
    p = paging(req)
    return answer(model, await fetch(p), p, req, **extra)
