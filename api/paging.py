"""How every list endpoint pages and sorts: ``limit``, an opaque ``cursor`` (the response's
``next`` link carries it), ``sort=field`` / ``sort=-field`` on a listed field, and ``offset``
kept for older clients. The cursor today encodes a position; clients treat it as opaque, so
it can become a keyset without any of them changing."""

from __future__ import annotations

import base64
import binascii
from typing import Any, ClassVar
from urllib.parse import urlencode

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from sqlmodel import col

_PREFIX = "o1:"


def encode_cursor(offset: int) -> str:
    return base64.urlsafe_b64encode(f"{_PREFIX}{offset}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raw = ""
    if not raw.startswith(_PREFIX) or not raw[len(_PREFIX) :].isdigit():
        raise ValueError("not a cursor this API issued; follow the 'next' link of a list answer")
    offset = int(raw[len(_PREFIX) :])
    if offset > (1 << 31) - 1:
        raise ValueError("not a cursor this API issued")
    return offset


class PageQuery(BaseModel):
    """Paging and sorting of a list call; the default page size is api.page_size."""

    model_config = ConfigDict(extra="forbid")
    #: Fields ``sort`` may name (each list endpoint's own query class sets them).
    SORTABLE: ClassVar[tuple[str, ...]] = ()

    limit: int | None = Field(
        default=None, ge=1, le=1000, description="Page size (default: the api.page_size setting)."
    )
    cursor: str | None = Field(
        default=None, max_length=64, description="Opaque; from the previous page's 'next' link."
    )
    offset: int = Field(
        default=0, ge=0, le=(1 << 31) - 1, description="Items to skip (prefer cursor)."
    )
    sort: str | None = Field(
        default=None, max_length=64, description="A listed field, '-field' for descending."
    )

    @field_validator("sort")
    @classmethod
    def _known_field(cls, v: str | None) -> str | None:
        if v is not None and v.removeprefix("-") not in cls.SORTABLE:
            raise ValueError(f"sort by one of: {', '.join(cls.SORTABLE)} (prefix - to reverse)")
        return v

    @model_validator(mode="after")
    def _cursor_is_offset(self) -> PageQuery:
        if self.cursor is not None:
            if self.offset:
                raise ValueError("send cursor or offset, not both")
            self.offset = decode_cursor(self.cursor)
        return self


def sorted_by(stmt: Any, model: Any, q: PageQuery, default: list[Any]) -> Any:
    """``stmt`` ordered by the query's sort field (then id, so pages never overlap), else by
    ``default``."""
    if q.sort is None:
        return stmt.order_by(*default)
    column = col(getattr(model, q.sort.removeprefix("-")))
    first = column.desc() if q.sort.startswith("-") else column.asc()
    return stmt.order_by(first, col(model.id))


def next_link(path: str, query: Any, offset: int, count: int, total: int) -> str | None:
    """The link to the page after one of ``count`` items at ``offset``, or None at the end."""
    if count == 0 or offset + count >= total:
        return None
    params = [(k, v) for k, v in query.items() if k not in ("cursor", "offset")]
    params.append(("cursor", encode_cursor(offset + count)))
    return f"{path}?{urlencode(params)}"
