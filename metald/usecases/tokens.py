"""API tokens as an admin manages them: issue (scope checked against what exists), list
(never a secret or hash), revoke (its event streams end at once)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlmodel import Session, col, select

from metald.auth import (
    Principal,
    Role,
    authenticate,
    issue_token,
    lookup,
    record_first_use,
    revoke_token,
)
from metald.errors import Conflict, NotFound, Unprocessable
from metald.machines import add_event
from metald.store import Store
from metald.store.models import ApiToken, Machine, Tenant
from metald.usecases import Transactions, Writes
from metald.usecases.names import resolve
from metald.usecases.reads import Page, Pager, page

#: Oldest first.
DEFAULT_ORDER = ["created_at", "id"]


async def principal_of(store: Store, secret: str) -> Principal | None:
    """The caller a bearer ``secret`` names, read aside the store's writes
    (``Store.read_aside``: a token look-up never queues behind them). An agent token's first
    use is left to the caller (``Principal.first_use``; ``record_use``)."""
    return await store.read_aside(lookup, secret)


async def record_use(store: Writes, token_id: str) -> None:
    """Record an agent token's first use in a commit of its own."""

    def stamp(s: Session) -> None:
        record_first_use(s, token_id)
        s.commit()

    await store.run(stamp)


async def still_authenticated(store: Transactions, secret: str) -> bool:
    """Whether the token ``secret`` still stands (not revoked, not expired): what a
    long-lived request (the serial console) checks again while it is open."""
    return await store.run(authenticate, secret) is not None


def token_view(row: ApiToken) -> dict[str, Any]:
    return row.model_dump(exclude={"token_hash"})


def _views(_: Session, rows: list[ApiToken]) -> list[dict[str, Any]]:
    return [token_view(r) for r in rows]


#: What a role's scope names, for references by name or id prefix.
SCOPE_KINDS = {Role.ORCHESTRATOR: "tenants", Role.AGENT: "machines"}


def check_scope(s: Session, role: Role, scope: list[str]) -> None:
    """An orchestrator's scope names tenants, an agent's a machine: each must exist."""
    if role is Role.ORCHESTRATOR:
        known = {t.id for t in s.exec(select(Tenant).where(col(Tenant.id).in_(scope)))}
        missing = [x for x in scope if x not in known]
        if missing:
            raise Unprocessable(f"scope names tenants that do not exist: {', '.join(missing)}")
    if role is Role.AGENT and scope and s.get(Machine, scope[0]) is None:
        raise Unprocessable(f"scope names a machine that does not exist: {scope[0]}")


@dataclass
class Tokens:
    store: Transactions
    instance: str
    #: Wakes the live event streams; ``tokens=True`` makes them re-check their tokens now.
    notify: Callable[..., None]

    async def issue(
        self,
        *,
        actor: str,
        name: str,
        role: Role,
        scope: list[str],
        ttl_seconds: int | None,
        caller: Principal | None = None,
    ) -> tuple[dict[str, Any], str]:
        """A token with a role and scope: its view and its secret (stored nowhere). The scope
        takes what a path takes (tenants, or the agent's machine, by id, name or 8+ character
        id prefix); the token holds their ids."""

        def run(s: Session) -> tuple[dict[str, Any], str]:
            nonlocal scope
            kind = SCOPE_KINDS.get(role)
            if kind is not None and caller is not None:
                try:
                    scope = [resolve(s, caller, kind, ref) for ref in scope]
                except NotFound as e:  # a too-short prefix: an invalid field (422)
                    raise Unprocessable(f"scope: {e.detail}") from None
            check_scope(s, role, scope)
            row, secret = issue_token(
                s,
                name=name,
                role=role,
                scope=scope,
                created_by=actor,
                ttl=timedelta(seconds=ttl_seconds) if ttl_seconds else None,
                commit=False,
            )
            add_event(
                s,
                "token.created",
                actor,
                data={"token_id": row.id, "name": row.name, "role": row.role, "scope": row.scope},
                instance=self.instance,
            )
            s.commit()
            return token_view(row), secret

        return await self.store.run(run)

    async def list(self, pager: Pager) -> Page[dict[str, Any]]:
        """Every token, revoked and expired ones until the purge removes them."""
        return await self.store.read(
            lambda s: page(s, select(ApiToken), ApiToken, pager, DEFAULT_ORDER, _views)
        )

    async def revoke(self, token_id: str, *, actor: str, caller_token_id: str) -> dict[str, Any]:
        """Revoke a token at once (not the caller's own); its event streams end now."""
        if token_id == caller_token_id:
            raise Conflict(
                "refusing to revoke the token making this request; use another admin token"
            )

        def run(s: Session) -> dict[str, Any]:
            row = revoke_token(s, token_id)
            add_event(
                s,
                "token.revoked",
                actor,
                data={"token_id": row.id, "name": row.name},
                instance=self.instance,
            )
            s.commit()
            return token_view(row)

        out = await self.store.run(run)
        self.notify(tokens=True)  # its event streams end now, not at the next re-check
        return out
