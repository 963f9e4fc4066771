"""How every list endpoint pages and sorts: ``limit``, an opaque ``cursor`` (the response's
``next`` link carries it), ``sort=field`` / ``sort=-field`` on a listed field, and ``offset``
kept for older clients.

The cursor is a keyset: the sort key of the last row sent (its sort field's value, then its
id), so the next page is "rows after that key", not "rows after position N". Rows inserted or
deleted while a client walks the pages do not shift the walk: it never repeats a row nor skips
one that existed when it started. A cursor is bound to its sort (a different ``sort`` with it
is a 422). Lists built in memory (BMCs, instances) page by the same rules (``page_items``).
Cursors of the earlier offset form (``o1:``) are still accepted."""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import cmp_to_key
from typing import Any, ClassVar
from urllib.parse import urlencode

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from sqlalchemy import Boolean, DateTime, Float, Integer, Numeric, String, and_, false, or_
from sqlalchemy.types import TypeDecorator
from sqlmodel import col

#: Integers a cursor may carry: those a signed 64-bit column holds (``api.routing`` refuses
#: the same in bodies and queries).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_OFFSET = "o1:"
_KEYSET = "k1:"
#: Longest cursor accepted and issued (kept well inside a request line's 8 KiB). A key too
#: long to carry (a long sort value) is sent as a reference to its row instead, read back
#: when the next page is asked for.
MAX_CURSOR = 512
#: An order: field names, ``-`` for descending; the last is always ``id`` (unique: a total
#: order, so no two rows share a key).
Order = list[str]


def _b64(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _unb64(cursor: str) -> str:
    try:
        return base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return ""


def encode_cursor(offset: int) -> str:
    """An offset cursor (the earlier form; still accepted)."""
    return _b64(f"{_OFFSET}{offset}")


def _wire(v: Any) -> Any:
    if isinstance(v, datetime):
        return {"dt": v.isoformat()}
    if v is None or isinstance(v, bool | int | float | str):
        return v
    return str(v)  # an enum member: its value


def _unwire(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) != {"dt"} or not isinstance(v["dt"], str):
            raise ValueError
        return datetime.fromisoformat(v["dt"])
    if v is None or isinstance(v, bool | int | float | str):
        return v
    raise ValueError


class Ref(str):
    """A keyset cursor that names the last row by its id (its key was too long to carry)."""


def encode_keyset(order: Order, values: Sequence[Any]) -> str:
    cursor = _b64(_KEYSET + json.dumps({"o": order, "v": [_wire(v) for v in values]}))
    if len(cursor) <= MAX_CURSOR:
        return cursor
    return _b64(_KEYSET + json.dumps({"o": order, "r": str(values[-1])}))


def decode_cursor(cursor: str) -> int | tuple[Order, list[Any] | Ref]:
    """An offset (older cursors) or the (order, last key or its row's id) of a keyset."""
    bad = ValueError("not a cursor this API issued; follow the 'next' link of a list answer")
    raw = _unb64(cursor)
    if raw.startswith(_OFFSET):
        digits = raw[len(_OFFSET) :]
        if not digits.isdigit() or int(digits) > (1 << 31) - 1:
            raise bad
        return int(digits)
    if not raw.startswith(_KEYSET):
        raise bad
    try:
        data = json.loads(raw[len(_KEYSET) :])
        order = data["o"]
        if "r" in data:
            if not isinstance(data["r"], str):
                raise ValueError
            return _checked(order, len(order)), Ref(data["r"])
        values = [_unwire(v) for v in data["v"]]
        return _checked(order, len(values)), values
    except (ValueError, KeyError, TypeError):
        raise bad from None


def _checked(order: Any, n: int) -> Order:
    if not isinstance(order, list) or not all(isinstance(o, str) for o in order):
        raise ValueError
    if len(order) != n or not order:
        raise ValueError
    return order


class PageQuery(BaseModel):
    """Paging and sorting of a list call; the default page size is api.page_size."""

    model_config = ConfigDict(extra="forbid")
    #: Fields ``sort`` may name (each list endpoint's own query class sets them).
    SORTABLE: ClassVar[tuple[str, ...]] = ()

    limit: int | None = Field(
        default=None, ge=1, le=1000, description="Page size (default: the api.page_size setting)."
    )
    cursor: str | None = Field(
        default=None,
        max_length=MAX_CURSOR,
        description="Opaque; from the previous page's 'next' link (stable under inserts).",
    )
    offset: int = Field(
        default=0, ge=0, le=(1 << 31) - 1, description="Items to skip (prefer cursor)."
    )
    sort: str | None = Field(
        default=None, max_length=64, description="A listed field, '-field' for descending."
    )
    #: The decoded keyset cursor: the order it was issued for and the last key sent.
    _after: tuple[Order, list[Any] | Ref] | None = None

    @field_validator("sort")
    @classmethod
    def _known_field(cls, v: str | None) -> str | None:
        if v is not None and v.removeprefix("-") not in cls.SORTABLE:
            raise ValueError(f"sort by one of: {', '.join(cls.SORTABLE)} (prefix - to reverse)")
        return v

    @model_validator(mode="after")
    def _decode_cursor(self) -> PageQuery:
        if self.cursor is not None:
            if self.offset:
                raise ValueError("send cursor or offset, not both")
            decoded = decode_cursor(self.cursor)
            if isinstance(decoded, int):
                self.offset = decoded
            else:
                self._after = decoded
        return self

    def order(self, default: Order) -> Order:
        """The order this query lists in: ``sort`` then id, else ``default``."""
        return [self.sort, "id"] if self.sort is not None else list(default)

    def after(self, order: Order) -> list[Any] | Ref | None:
        """The last key of the previous page, for ``order``; 422 when the cursor was issued
        for another sort."""
        if self._after is None:
            return None
        issued, values = self._after
        if issued != order:
            from metald.errors import Unprocessable

            raise Unprocessable(
                "this cursor belongs to a list sorted another way; follow the 'next' link as "
                "it is, or start again without a cursor"
            )
        return values


def _columns(model: Any, order: Order) -> list[tuple[Any, bool, bool]]:
    """(column, descending, nullable) for each field of ``order``."""
    out = []
    for field in order:
        name = field.removeprefix("-")
        out.append(
            (col(getattr(model, name)), field.startswith("-"), model.__table__.c[name].nullable)
        )
    return out


_BAD_KEY = (
    "this cursor's values do not fit the list's sort fields; it was not issued by this API: "
    "follow the 'next' link as it is, or start again without a cursor"
)


def _key_error(detail: str = _BAD_KEY) -> Exception:
    from metald.errors import Unprocessable

    return Unprocessable(detail)


def _text_ok(v: Any) -> bool:
    return isinstance(v, str) and "\x00" not in v


def _fits(column: Any, v: Any) -> bool:
    """Whether ``v`` (a cursor value) can be bound against ``column`` on every backend: the
    column's type, integers within 64 bits, text without NUL (PostgreSQL refuses both at the
    driver, SQLite the first), a timestamp the driver can send."""
    if v is None:
        return True
    t = column.type
    if isinstance(t, TypeDecorator):  # sqlmodel's AutoString: a String underneath
        t = t.impl
    if isinstance(t, Boolean):
        return isinstance(v, bool)
    if isinstance(t, Integer):
        return isinstance(v, int) and not isinstance(v, bool) and INT64_MIN <= v <= INT64_MAX
    if isinstance(t, Float | Numeric):
        ok = isinstance(v, int | float) and not isinstance(v, bool)
        return ok and math.isfinite(v)
    if isinstance(t, String):
        return _text_ok(v)
    if isinstance(t, DateTime):
        return isinstance(v, datetime)
    return False  # a column no list sorts by (JSON): nothing a cursor may carry


def _check_key(model: Any, order: Order, after: list[Any] | Ref) -> None:
    """A decoded cursor's values checked against the columns they are compared with, so a
    forged cursor is a 422, never a driver error (a 500)."""
    if isinstance(after, Ref):
        if not _text_ok(after):
            raise _key_error()
        return
    for field, v in zip(order, after, strict=True):
        if not _fits(model.__table__.c[field.removeprefix("-")], v):
            raise _key_error()


def _after_clause(columns: list[tuple[Any, bool, bool]], values: list[Any]) -> Any:
    """Rows whose key comes after ``values`` in the order of ``columns`` (NULLs last)."""
    terms: list[Any] = []
    equal: list[Any] = []
    for (c, desc, nullable), v in zip(columns, values, strict=True):
        if v is None:
            if not nullable:
                return false()
            # Among NULLs there is no "after" on this column: only later columns decide.
            equal.append(c.is_(None))
            continue
        later = c < v if desc else c > v
        if nullable:
            later = or_(later, c.is_(None))  # NULLs come after every value
        terms.append(and_(*equal, later))
        equal.append(c == v)
    return or_(*terms) if terms else false()


def page_rows(
    session: Any, stmt: Any, model: Any, q: PageQuery, default: Order, limit: int
) -> tuple[list[Any], str | None]:
    """One page of ``stmt`` (filters applied, no order yet) in the query's order, and the
    cursor of the next page (None on the last)."""
    order = q.order(default)
    columns = _columns(model, order)
    keys: list[Any] = []
    for c, desc, nullable in columns:
        if nullable:
            keys.append(c.is_(None).asc())
        keys.append(c.desc() if desc else c.asc())
    stmt = stmt.order_by(*keys)
    after = q.after(order)
    if after is not None:
        _check_key(model, order, after)
    if isinstance(after, Ref):
        # Looked up through the list's own filters (the caller's scope among them), so a
        # forged reference to a row the caller cannot list reveals nothing of where it sorts.
        row = session.exec(stmt.where(col(model.id) == str(after)).limit(1)).first()
        if row is None:
            raise _gone()
        after = [getattr(row, f.removeprefix("-")) for f in order]
    if after is not None:
        stmt = stmt.where(_after_clause(columns, after))
    elif q.offset:
        stmt = stmt.offset(q.offset)
    rows = list(session.exec(stmt.limit(limit + 1)))
    return _cut(rows, order, limit, lambda r, f: getattr(r, f))


def _cut(
    rows: list[Any], order: Order, limit: int, get: Callable[[Any, str], Any]
) -> tuple[list[Any], str | None]:
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    last = rows[-1]
    return rows, encode_keyset(order, [get(last, f.removeprefix("-")) for f in order])


def _compare(a: Sequence[Any], b: Sequence[Any], order: Order) -> int:
    for x, y, field in zip(a, b, order, strict=True):
        if x == y:
            continue
        if x is None or y is None:
            return 1 if x is None else -1  # NULLs last, either direction
        c = (x > y) - (x < y)
        return -c if field.startswith("-") else c
    return 0


def page_items(
    items: list[Any], q: PageQuery, default: Order, limit: int, get: Callable[[Any, str], Any]
) -> tuple[list[Any], str | None]:
    """``page_rows`` for a list held in memory; ``get(item, field)`` reads a sort field."""
    order = q.order(default)

    def key(item: Any) -> list[Any]:
        return [get(item, f.removeprefix("-")) for f in order]

    ordered = sorted(items, key=cmp_to_key(lambda a, b: _compare(key(a), key(b), order)))
    after = q.after(order)
    if isinstance(after, Ref):
        found = [i for i in items if str(get(i, "id")) == after]
        if not found:
            raise _gone()
        after = key(found[0])
    if after is not None:
        try:
            ordered = [i for i in ordered if _compare(key(i), after, order) > 0]
        except TypeError:  # a forged key whose values do not compare with the fields'
            raise _key_error() from None
    elif q.offset:
        ordered = ordered[q.offset :]
    return _cut(ordered[: limit + 1], order, limit, get)


def _gone() -> Exception:
    from metald.errors import Unprocessable

    return Unprocessable(
        "the row this cursor continues after is gone; start the list again without a cursor"
    )


def next_link(path: str, query: Any, cursor: str | None) -> str | None:
    """The link to the next page (the request's own parameters, the new cursor)."""
    if cursor is None:
        return None
    params = [(k, v) for k, v in query.items() if k not in ("cursor", "offset")]
    params.append(("cursor", cursor))
    return f"{path}?{urlencode(params)}"
