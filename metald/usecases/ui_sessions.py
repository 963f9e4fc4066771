"""The web console's sessions: opened with an API token once, kept server-side, bound to that
token. Store functions (a ``Session`` in, rows and decisions out), each in a transaction of its own
through ``UiSessions``; ``api.ui.guard`` loads the session on every request.

The cookie carries a random 256-bit id; the store keeps its SHA-256 (a copy of the database
opens no session) and the id of the token it was opened with, never the token's secret. A
session ends when it is idle for ``IDLE``, at ``ABSOLUTE`` after login, at logout, and at once
when its token is revoked or expires (every request resolves the principal from the token
again, by the API's own rules: ``metald.auth.principal_of_token``)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlmodel import Session, delete

from metald.auth import Principal, Role, authenticate, principal_of_token
from metald.store.models import ApiToken, UiSession, as_utc, utcnow
from metald.usecases import Writes

#: A session unused this long ends (the live pages' event stream counts as use).
IDLE = timedelta(hours=1)
#: A session ends this long after login, used or not: one shift.
ABSOLUTE = timedelta(hours=12)
#: ``last_seen_at`` is written at most this often (not on every request of a busy page).
TOUCH_EVERY = timedelta(seconds=60)
#: Roles that may log in: an agent token belongs to a machine's boot, not to a person.
PEOPLE = frozenset({Role.ADMIN, Role.TECHNICIAN, Role.ORCHESTRATOR})


def _hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


@dataclass(frozen=True)
class Opened:
    session_id: str  # for the cookie only; never stored, never logged
    csrf: str
    principal: Principal


@dataclass(frozen=True)
class Live:
    row: UiSession
    principal: Principal


class LoginRefused(Exception):
    """Why a token cannot open a session, as a sentence for the login page."""


def open_session(s: Session, secret: str, *, now: datetime | None = None) -> Opened:
    """A new session for the holder of ``secret`` (an API token), or LoginRefused."""
    principal = authenticate(s, secret.strip())
    if principal is None:
        raise LoginRefused(
            "that token is not valid: it is unknown, revoked or expired; paste a token "
            "metalctl or an admin gave you (it starts with mtd_)"
        )
    if principal.role not in PEOPLE:
        raise LoginRefused(
            f"{principal.role.value} tokens cannot log in to the console; use an admin, "
            "technician or orchestrator token"
        )
    now = now or utcnow()
    ends = now + ABSOLUTE
    token = s.get(ApiToken, principal.token_id)
    if token is not None and token.expires_at is not None:
        ends = min(ends, as_utc(token.expires_at))  # never outlives its token
    _purge(s, now)  # sessions nobody came back to go at the next login (a small table)
    session_id = secrets.token_urlsafe(32)
    csrf = secrets.token_urlsafe(32)
    s.add(
        UiSession(
            id_hash=_hash(session_id),
            token_id=principal.token_id,
            csrf=csrf,
            created_at=now,
            last_seen_at=now,
            expires_at=ends,
        )
    )
    s.commit()
    return Opened(session_id, csrf, principal)


def load_session(s: Session, session_id: str, *, now: datetime | None = None) -> Live | None:
    """The live session behind a cookie and its principal, or None (and the row deleted)
    when it is unknown, idle too long, past its absolute end, or its token no longer acts."""
    if not session_id or len(session_id) > 128:
        return None
    row = s.get(UiSession, _hash(session_id))
    if row is None:
        return None
    now = now or utcnow()
    principal = principal_of_token(s, row.token_id)
    ended = (
        principal is None or as_utc(row.expires_at) <= now or as_utc(row.last_seen_at) + IDLE <= now
    )
    if ended:
        s.delete(row)
        s.commit()
        return None
    assert principal is not None
    if as_utc(row.last_seen_at) + TOUCH_EVERY <= now:
        row.last_seen_at = now
        s.add(row)
        s.commit()
        s.refresh(row)
    return Live(row, principal)


def close_session(s: Session, session_id: str) -> None:
    """Logout: the row goes, so the cookie opens nothing any more."""
    s.exec(delete(UiSession).where(UiSession.id_hash == _hash(session_id)))  # type: ignore[call-overload]
    s.commit()


def _purge(s: Session, now: datetime) -> None:
    """Delete the sessions past their absolute end or idle too long (not committed)."""
    s.exec(  # type: ignore[call-overload]
        delete(UiSession).where(
            (UiSession.expires_at <= now) | (UiSession.last_seen_at <= now - IDLE)  # type: ignore[operator]
        )
    )


def csrf_matches(expected: str, presented: str | None) -> bool:
    """The synchronizer token check, in constant time."""
    return presented is not None and hmac.compare_digest(
        expected.encode(), presented.encode("utf-8", "replace")
    )


@dataclass
class UiSessions:
    """Console sessions, each step in a transaction of its own."""

    store: Writes

    async def open(self, secret: str) -> Opened:
        """Log in with an API token (``LoginRefused``: not a live token of a person)."""
        return await self.store.run(open_session, secret)

    async def load(self, session_id: str) -> Live | None:
        """The session if it still stands (touched: it counts as use)."""
        return await self.store.run(load_session, session_id)

    async def close(self, session_id: str) -> None:
        await self.store.run(close_session, session_id)
