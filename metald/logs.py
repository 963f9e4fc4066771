"""Logging: human text or one JSON object per line, and a filter that keeps secrets out."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime

# Bearer tokens and anything that looks like a password assignment never reach a log line.
_REDACT = [
    # Whatever follows "Bearer" is a credential, even if it is not one of ours (or truncated).
    (re.compile(r"(?i)\b(bearer)(\s+)[^\s'\",}]+"), r"\1\2<redacted>"),
    (re.compile(r"mtd_[A-Za-z0-9_-]{4,}"), "mtd_<redacted>"),
    (
        re.compile(
            r"(?i)(password|passwd|secret|private_key|token)(['\"]?\s*[:=]\s*['\"]?)[^\s'\",}]+"
        ),
        r"\1\2<redacted>",
    ),
]


def redact(text: str) -> str:
    for pat, repl in _REDACT:
        text = pat.sub(repl, text)
    return text


class RedactingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        clean = redact(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        return True


class StoreOutageFilter(logging.Filter):
    """A database that cannot be reached (PostgreSQL restarting or failing over, this instance
    cut off) is an expected condition every loop survives and retries: its records become one
    warning line without a traceback, whichever loop logged them (docs/fleet.md).

    ``is_outage`` tells such an exception (``metald.store.db.store_unavailable``; passed in by
    the program, as logging sits below the store)."""

    def __init__(self, is_outage: Callable[[BaseException], bool]) -> None:
        super().__init__()
        self.is_outage = is_outage

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        if self.is_outage(exc):
            record.msg = f"{record.getMessage()}: database unavailable ({type(exc).__name__})"
            record.args, record.exc_info, record.exc_text = None, None, None
            if record.levelno > logging.WARNING:
                record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class RedactingFormatter(logging.Formatter):
    """Redacts the whole formatted record: message, arguments, traceback and stack, so a
    secret inside an exception (say, a header a parser quotes back) never reaches the log."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line; every string in it redacted before it is encoded."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        for key in ("machine_id", "mac", "bmc_id", "event"):
            if hasattr(record, key):
                value = getattr(record, key)
                out[key] = redact(value) if isinstance(value, str) else value
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        if record.stack_info:
            out["stack"] = redact(self.formatStack(record.stack_info))
        return json.dumps(out, default=lambda o: redact(str(o)))


def setup_logging(
    level: str = "info",
    fmt: str = "text",
    is_outage: Callable[[BaseException], bool] | None = None,
) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if is_outage is not None:
        handler.addFilter(StoreOutageFilter(is_outage))
    handler.addFilter(RedactingFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            RedactingFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Third-party chatter at DEBUG can include request bodies; keep it at WARNING.
    for noisy in ("aiohttp.access", "pyghmi", "tftpy", "sqlalchemy.engine", "alembic"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
