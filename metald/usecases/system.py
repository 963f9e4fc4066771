"""What the health probe asks of the store (``/healthz``)."""

from __future__ import annotations

from sqlalchemy import text
from sqlmodel import Session

from metald.usecases import Writes


def _ping(s: Session) -> None:
    s.exec(text("SELECT 1"))  # type: ignore[call-overload]


async def database_status(store: Writes) -> str:
    """ "ok" when the database answers a statement, else "error: <what was raised>" (any
    failure counts: the probe reports it, it never raises)."""
    try:
        await store.run(_ping)
    except Exception as e:  # noqa: BLE001 - any database failure is "unhealthy"
        return f"error: {type(e).__name__}"
    return "ok"
