"""API tokens: issue, hash, verify, and the roles and scopes they carry.

A token is ``mtd_<random>``; only its SHA-256 is stored (the secret has 256 bits of entropy, so
a fast hash is enough and lookups stay O(1)). The secret is shown once, when it is issued.
Roles:

- ``admin``: everything, including tokens.
- ``technician``: the fleet (machines, BMCs, power, events); not tokens, not tenants' claims.
- ``orchestrator``: claims for the tenants in its scope, and those tenants' machines.
- ``agent``: the one machine in its scope (inventory, progress, next instruction), in the one
  phase it was minted for (``lifecycle.PHASES``: inspect, provision, wipe), checked by
  ``require_agent_phase``; every phase change revokes the machine's agent tokens.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, or_
from sqlalchemy import select as sa_select
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from metald.errors import Conflict, NotFound, Unprocessable
from metald.lifecycle import phase_of
from metald.store.models import ApiToken, Machine, Meta, as_utc, new_id, utcnow

TOKEN_PREFIX = "mtd_"


class Role(StrEnum):
    ADMIN = "admin"
    TECHNICIAN = "technician"
    ORCHESTRATOR = "orchestrator"
    AGENT = "agent"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's identity, role and scope."""

    token_id: str
    name: str
    role: Role
    scope: frozenset[str] = field(default_factory=frozenset)
    #: Agent tokens: the phase and the boot (``Machine.boot_current``) they were minted for.
    phase: str | None = None
    boot: str | None = None
    #: An agent token presented for the first time (``lookup``): the request must record it
    #: (``record_first_use``), in its own write transaction or in one more.
    first_use: bool = field(default=False, compare=False)

    @property
    def actor(self) -> str:
        return f"{self.role.value}:{self.name}"

    def can_see_tenant(self, tenant_id: str | None) -> bool:
        if self.role in (Role.ADMIN, Role.TECHNICIAN):
            return True
        if self.role is Role.ORCHESTRATOR:
            return tenant_id is not None and tenant_id in self.scope
        return False

    def can_see_machine(self, machine_id: str, tenant_id: str | None) -> bool:
        if self.role in (Role.ADMIN, Role.TECHNICIAN):
            return True
        if self.role is Role.AGENT:
            return machine_id in self.scope
        return self.can_see_tenant(tenant_id)


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def issue_token(
    session: Session,
    *,
    name: str,
    role: Role | str,
    scope: list[str] | None = None,
    created_by: str | None = None,
    ttl: timedelta | None = None,
    commit: bool = True,
    phase: str | None = None,
    boot: str | None = None,
) -> tuple[ApiToken, str]:
    """Create a token; returns the row and the secret (which is not stored). An agent token is
    bound to ``phase`` (by default its machine's phase now) and, when minted from a boot
    script, to that ``boot``; no boot means no wipe can be reported done with it."""
    role = Role(role)
    scope = list(scope or [])
    if role is Role.AGENT and len(scope) != 1:
        raise Unprocessable("an agent token is scoped to exactly one machine id")
    if role is Role.ORCHESTRATOR and not scope:
        raise Unprocessable("an orchestrator token needs at least one tenant id in its scope")
    if role in (Role.ADMIN, Role.TECHNICIAN) and scope:
        raise Unprocessable(f"a {role.value} token is not scoped; leave scope empty")
    if role is Role.AGENT and phase is None:
        m = session.get(Machine, scope[0])
        phase = phase_of(m.state) if m is not None else None
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(
        name=name,
        role=role.value,
        scope=scope,
        token_hash=hash_token(secret),
        machine_id=scope[0] if role is Role.AGENT else None,
        created_by=created_by,
        expires_at=utcnow() + ttl if ttl else None,
        phase=phase if role is Role.AGENT else None,
        boot=boot if role is Role.AGENT else None,
    )
    session.add(row)
    if commit:
        session.commit()
    return row, secret


def issue_agent_token(
    session: Session,
    machine_id: str,
    *,
    name: str,
    phase: str | None,
    boot: str | None,
    created_by: str | None = None,
    ttl: timedelta | None = None,
) -> str:
    """``issue_token`` for an agent token minted on a boot script's way out (every machine of a
    power-on storm gets one): the same row by a Core INSERT, with no ``ApiToken`` object built
    and flushed. Returns the secret (shown once); no commit."""
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.connection().execute(
        _TOKEN_INSERT,
        {
            "id": new_id(),
            "name": name,
            "role": Role.AGENT.value,
            "scope": [machine_id],
            "machine_id": machine_id,
            "phase": phase,
            "boot": boot,
            "token_hash": hash_token(secret),
            "created_by": created_by,
            "created_at": utcnow(),
            "expires_at": utcnow() + ttl if ttl else None,
        },
    )
    return secret


def authenticate(session: Session, secret: str) -> Principal | None:
    """The principal for a presented secret, or None if unknown, revoked or expired; an agent
    token's first use is recorded and committed here (``lookup`` leaves that to the caller)."""
    p = lookup(session, secret)
    if p is not None and p.first_use:
        record_first_use(session, p.token_id)
        session.commit()
    return p


def lookup(session: Session, secret: str) -> Principal | None:
    """``authenticate`` without writing: one SELECT, so it runs in a read-only transaction
    (``Store.read_aside``) and never waits on the writer. ``first_use`` says the caller must record
    the agent token's first use (``record_first_use``) before it answers."""
    if not secret.startswith(TOKEN_PREFIX):
        return None
    row = session.connection().execute(_BY_HASH, {"h": hash_token(secret)}).first()
    if not _live(row):
        return None
    # An agent token's first use, once: the watchdog tells a boot whose script answer was lost
    # (token minted, never used) from one whose agent runs (``watchdog.stranded_boots``).
    first = row.role == Role.AGENT.value and row.last_used_at is None
    return Principal(
        row.id, row.name, Role(row.role), frozenset(row.scope), row.phase, row.boot, first
    )


def record_first_use(session: Session, token_id: str) -> None:
    """Stamp an agent token's first use (no commit): a conditional UPDATE, a no-op once the
    token has been used, so recording it twice (a retry, two requests at once) is harmless."""
    session.connection().execute(_FIRST_USE, {"i": token_id, "at": utcnow()})


def _live(row: Any) -> bool:
    """Whether a token row may act: it exists, is not revoked and has not expired."""
    if row is None or row.revoked_at is not None:
        return False
    return row.expires_at is None or as_utc(row.expires_at) > utcnow()


def principal_of_token(session: Session, token_id: str) -> Principal | None:
    """The principal of the token with this id, by the same rules as ``authenticate`` (None
    once it is revoked or expired): for callers bound to a token they no longer hold, like a
    web console session (``metald.usecases.ui_sessions``). Agent tokens act only with their secret."""
    row = session.connection().execute(_BY_ID, {"i": token_id}).first()
    if not _live(row) or row.role == Role.AGENT.value:
        return None
    return Principal(row.id, row.name, Role(row.role), frozenset(row.scope), row.phase, row.boot)


class PhaseMismatch(Conflict):
    title = "Agent token of another phase"


def require_agent_phase(p: Principal, machine_state: str, allowed: set[str]) -> str:
    """The phase of an agent's machine, if the token was minted for it and it is one of
    ``allowed``; raises PhaseMismatch (409: the role may call the endpoint, the machine is not
    in this token's phase) otherwise: a token of an earlier phase, e.g. the discovery image's
    once the machine is claimed, acts for nothing."""
    phase = phase_of(machine_state)
    if p.phase is None or p.phase != phase or phase not in allowed:
        minted = f"the {p.phase} phase" if p.phase else "no phase"
        raise PhaseMismatch(
            f"this agent token was minted for {minted} and the machine is {machine_state} "
            f"(phase {phase or 'none'}); an agent token acts only in the phase it was minted "
            f"for ({', '.join(sorted(allowed))} here): boot the machine again for a new one",
            token_phase=p.phase,
            machine_state=machine_state,
        )
    return phase


#: Every API request runs this: columns, not an ApiToken object, and the statement built once.
_TOKENS = ApiToken.__table__  # type: ignore[attr-defined]
_TOKEN_COLUMNS = (
    _TOKENS.c.id,
    _TOKENS.c.name,
    _TOKENS.c.role,
    _TOKENS.c.scope,
    _TOKENS.c.expires_at,
    _TOKENS.c.revoked_at,
    _TOKENS.c.phase,
    _TOKENS.c.boot,
    _TOKENS.c.last_used_at,
)
_TOKEN_INSERT = _TOKENS.insert()
_BY_HASH = sa_select(*_TOKEN_COLUMNS).where(_TOKENS.c.token_hash == bindparam("h"))
_BY_ID = sa_select(*_TOKEN_COLUMNS).where(_TOKENS.c.id == bindparam("i"))
_FIRST_USE = (
    _TOKENS.update()
    .where(_TOKENS.c.id == bindparam("i"), _TOKENS.c.last_used_at.is_(None))
    .values(last_used_at=bindparam("at"))
)
_REVOKE_MACHINE = (
    _TOKENS.update()
    .where(
        _TOKENS.c.machine_id == bindparam("m"),
        _TOKENS.c.role == Role.AGENT.value,
        _TOKENS.c.revoked_at.is_(None),
    )
    .values(revoked_at=bindparam("at"))
)


def revoke_token(session: Session, token_id: str) -> ApiToken:
    row = session.get(ApiToken, token_id)
    if row is None:
        raise NotFound(f"no token with id {token_id!r}")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.add(row)
        session.commit()
    return row


def revoke_machine_tokens(session: Session, machine_id: str, *, commit: bool = True) -> int:
    """Revoke every live agent token of the machine (on release, re-inspection, each boot):
    one UPDATE on the indexed ``machine_id`` (a token is minted per boot, so scanning every
    live token here made a power-on storm quadratic)."""
    n = session.connection().execute(_REVOKE_MACHINE, {"m": machine_id, "at": utcnow()}).rowcount
    if commit:
        session.commit()
    return n


#: Revoked and expired tokens stay listed this long (who had access, until when), then go.
TOKEN_RETENTION = timedelta(days=1)


def purge_tokens(
    session: Session, *, retention: timedelta = TOKEN_RETENTION, now: datetime | None = None
) -> int:
    """Delete the tokens revoked or expired more than ``retention`` ago (an agent token is
    minted per boot, so without this the table only grows). Returns how many went. The
    token.created/token.revoked events stay; the rows can no longer authenticate anyway."""
    cutoff = (now or utcnow()) - retention
    purge = _TOKENS.delete().where(
        or_(_TOKENS.c.revoked_at < cutoff, _TOKENS.c.expires_at < cutoff)
    )
    n = session.connection().execute(purge).rowcount
    session.commit()
    return n


def bootstrap_admin(session: Session, path: Path) -> Path | None:
    """On first start, create an admin token and write it to ``path`` (0600).

    Returns the path if a token was created. Idempotent: a ``meta`` row records that the
    installation was bootstrapped, so deleting the file does not mint a second admin silently.
    """
    if session.get(Meta, "admin_bootstrapped") is not None:
        return None
    _row, secret = issue_token(session, name="bootstrap-admin", role=Role.ADMIN, commit=False)
    session.add(Meta(key="admin_bootstrapped", value=utcnow().isoformat()))
    try:
        session.commit()
    except IntegrityError:  # another instance on the same database bootstrapped first
        session.rollback()
        return None
    write_secret_file(Path(path), secret)
    return Path(path)


def write_secret_file(path: Path, secret: str) -> None:
    """Write a secret to ``path`` atomically, readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
