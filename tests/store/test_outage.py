"""What counts as "the database is unavailable" (503 + Retry-After in the API, a warning without
a traceback in the logs), and what does not."""

from __future__ import annotations

import logging
import sqlite3

import psycopg
import pytest
from psycopg import errors as pg_errors
from sqlalchemy import exc as sa_exc

from metald.logs import StoreOutageFilter
from metald.store.db import store_unavailable


def _wrapped(orig: BaseException) -> sa_exc.DBAPIError:
    return sa_exc.DBAPIError.instance("SELECT 1", {}, orig, Exception)


@pytest.mark.parametrize(
    ("exc", "unavailable"),
    [
        (_wrapped(psycopg.OperationalError("connection refused")), True),  # no SQLSTATE: the link
        (_wrapped(pg_errors.AdminShutdown("terminating connection")), True),  # 57P01 (restart)
        (_wrapped(pg_errors.CannotConnectNow("the database system is starting up")), True),
        (sa_exc.TimeoutError("QueuePool limit reached"), True),
        (sa_exc.DisconnectionError("pre-ping failed"), True),
        (_wrapped(pg_errors.UniqueViolation("duplicate key")), False),
        (_wrapped(pg_errors.DeadlockDetected("deadlock")), False),  # a race: retried, not a 503
        (_wrapped(pg_errors.QueryCanceled("statement timeout")), False),
        (_wrapped(sqlite3.OperationalError("database is locked")), False),
        (ValueError("x"), False),
    ],
)
def test_store_unavailable(exc: BaseException, unavailable: bool) -> None:
    assert store_unavailable(exc) is unavailable


def _record(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:  # noqa: BLE001
        import sys

        info = sys.exc_info()
    return logging.LogRecord(
        "metald.x", logging.ERROR, __file__, 1, "round %s failed", ("7",), info
    )


def test_an_outage_is_logged_as_a_warning_without_a_traceback() -> None:
    rec = _record(_wrapped(psycopg.OperationalError("connection refused")))
    assert StoreOutageFilter(store_unavailable).filter(rec)
    assert rec.levelname == "WARNING" and rec.exc_info is None
    assert rec.getMessage() == "round 7 failed: database unavailable (OperationalError)"
    other = _record(ValueError("a bug"))
    assert StoreOutageFilter(store_unavailable).filter(other)
    assert other.levelname == "ERROR" and other.exc_info is not None
