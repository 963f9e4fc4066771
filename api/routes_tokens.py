"""/api/v1/tokens and /api/v1/whoami: who may do what."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func
from sqlmodel import Session, select

from api.paging import page_rows
from api.roles import ADMIN
from api.routing import ALL_ROLES, ApiRequest, Router
from api.schemas import (
    TokenCreate,
    TokenCreated,
    TokenList,
    TokenOut,
    TokenQuery,
    WhoAmI,
)
from metald.auth import Role, issue_token, revoke_token
from metald.errors import Conflict, Unprocessable
from metald.machines import add_event
from metald.store.models import ApiToken, Machine, Tenant

router = Router()


def _check_scope(s: Session, role: Role, scope: list[str]) -> None:
    if role is Role.ORCHESTRATOR:
        known = {t.id for t in s.exec(select(Tenant).where(Tenant.id.in_(scope)))}  # type: ignore[attr-defined]
        missing = [x for x in scope if x not in known]
        if missing:
            raise Unprocessable(f"scope names tenants that do not exist: {', '.join(missing)}")
    if role is Role.AGENT and scope and s.get(Machine, scope[0]) is None:
        raise Unprocessable(f"scope names a machine that does not exist: {scope[0]}")


@router.route(
    "POST",
    "/api/v1/tokens",
    summary="Create a token",
    roles=ADMIN,
    body=TokenCreate,
    response=TokenCreated,
    status=201,
    tag="tokens",
    errors=(422,),
    location="/api/v1/tokens/{id}",
)
async def create_token(req: ApiRequest) -> TokenCreated:
    """Issue a token with a role and scope. The secret is in the response and nowhere else."""
    b: TokenCreate = req.body

    def run(s: Session) -> TokenCreated:
        _check_scope(s, b.role, b.scope)
        row, secret = issue_token(
            s,
            name=b.name,
            role=b.role,
            scope=b.scope,
            created_by=req.actor,
            ttl=timedelta(seconds=b.ttl_seconds) if b.ttl_seconds else None,
            commit=False,
        )
        add_event(
            s,
            "token.created",
            req.actor,
            data={"token_id": row.id, "name": row.name, "role": row.role, "scope": row.scope},
            instance=req.ctx.instance,
        )
        s.commit()
        return TokenCreated(**TokenOut.model_validate(row.model_dump()).model_dump(), token=secret)

    return await req.ctx.store.run(run)


@router.route(
    "GET",
    "/api/v1/tokens",
    summary="List tokens",
    roles=ADMIN,
    query=TokenQuery,
    response=TokenList,
    tag="tokens",
)
async def list_tokens(req: ApiRequest) -> TokenList:
    """Tokens, oldest first, paginated (never their secrets or hashes). Revoked and expired
    tokens are listed until the token purge removes them."""
    q: TokenQuery = req.query
    limit = req.page_limit(q)

    def run(s: Session) -> TokenList:
        total = s.exec(select(func.count()).select_from(ApiToken)).one()
        rows, cursor = page_rows(s, select(ApiToken), ApiToken, q, ["created_at", "id"], limit)
        return TokenList(
            items=[TokenOut.model_validate(r.model_dump()) for r in rows],
            total=total,
            limit=limit,
            offset=q.offset,
            next=req.next_link(cursor),
        )

    return await req.ctx.store.read(run)


@router.route(
    "DELETE",
    "/api/v1/tokens/{id}",
    summary="Revoke a token",
    roles=ADMIN,
    response=TokenOut,
    tag="tokens",
    errors=(404, 409),
)
async def delete_token(req: ApiRequest) -> TokenOut:
    """Revoke a token at once. Revoking the token in use by this very request is refused."""
    p = req.require_principal()
    if req.params["id"] == p.token_id:
        raise Conflict("refusing to revoke the token making this request; use another admin token")

    def run(s: Session) -> TokenOut:
        row = revoke_token(s, req.params["id"])
        add_event(
            s,
            "token.revoked",
            req.actor,
            data={"token_id": row.id, "name": row.name},
            instance=req.ctx.instance,
        )
        s.commit()
        return TokenOut.model_validate(row.model_dump())

    out = await req.ctx.store.run(run)
    req.ctx.bus.notify(tokens=True)  # its event streams end now, not at the next re-check
    return out


@router.route(
    "GET",
    "/api/v1/whoami",
    summary="Show the calling token",
    roles=ALL_ROLES,
    response=WhoAmI,
    tag="tokens",
)
async def whoami(req: ApiRequest) -> WhoAmI:
    """The caller's token id, name, role and scope."""
    p = req.require_principal()
    return WhoAmI(token_id=p.token_id, name=p.name, role=p.role.value, scope=sorted(p.scope))
