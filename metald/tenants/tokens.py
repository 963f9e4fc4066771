"""One-time join tokens: issued per machine and tenant, short-lived, burned atomically on use.

The secret (``mjt_<random>``) is returned once; only its sha256 is stored. Burning is a single
compare-and-swap UPDATE (``WHERE used_at IS NULL``), so of two concurrent uses exactly one wins
on SQLite (writers serialise) and PostgreSQL (the row lock re-checks the condition).
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta

from sqlalchemy import update
from sqlmodel import Session, col, select

from metald.errors import Conflict, Unauthorized
from metald.store.models import JoinToken, as_utc, utcnow

PREFIX = "mjt_"
DEFAULT_TTL = timedelta(minutes=30)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def issue(
    session: Session,
    *,
    machine_id: str,
    tenant_id: str,
    ttl: timedelta = DEFAULT_TTL,
    created_by: str | None = None,
) -> tuple[JoinToken, str]:
    """Add a token row (not committed) and return it with its secret."""
    secret = PREFIX + secrets.token_urlsafe(32)
    row = JoinToken(
        token_hash=hash_secret(secret),
        machine_id=machine_id,
        tenant_id=tenant_id,
        expires_at=utcnow() + ttl,
        created_by=created_by,
    )
    session.add(row)
    return row, secret


def burn(session: Session, secret: str, *, now: datetime | None = None) -> JoinToken:
    """Mark the token used, in the caller's transaction, or raise with a sentence saying why.

    The caller commits; if it rolls back, the token stays usable.
    """
    now = now or utcnow()
    row = session.exec(select(JoinToken).where(JoinToken.token_hash == hash_secret(secret))).first()
    if row is None or row.revoked_at is not None:
        raise Unauthorized("this join token is unknown or revoked; ask for a new one")
    if row.used_at is not None:
        raise Conflict("this join token was already used; a join token works once")
    if as_utc(row.expires_at) <= now:
        raise Unauthorized("this join token has expired; ask for a new one")
    result = session.execute(
        update(JoinToken)
        .where(col(JoinToken.id) == row.id, col(JoinToken.used_at).is_(None))
        .values(used_at=now)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise Conflict("this join token was already used; a join token works once")
    session.refresh(row)
    return row


def revoke_for_machine(session: Session, machine_id: str, *, now: datetime | None = None) -> int:
    """Revoke the machine's unused tokens (on release). Not committed."""
    result = session.execute(
        update(JoinToken)
        .where(
            col(JoinToken.machine_id) == machine_id,
            col(JoinToken.used_at).is_(None),
            col(JoinToken.revoked_at).is_(None),
        )
        .values(revoked_at=now or utcnow())
    )
    return int(result.rowcount)  # type: ignore[attr-defined]
