"""/api/v1/tokens and /api/v1/whoami: who may do what."""

from __future__ import annotations

from api import listing, workflows
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
from metald.usecases.tokens import Tokens

router = Router()


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
    use_case=workflows.tokens,
)
async def create_token(req: ApiRequest, tokens: Tokens) -> TokenCreated:
    """Issue a token with a role and scope. The secret is in the response and nowhere else."""
    b: TokenCreate = req.body
    row, secret = await tokens.issue(
        actor=req.actor,
        name=b.name,
        role=b.role,
        scope=b.scope,
        ttl_seconds=b.ttl_seconds,
        caller=req.require_principal(),
    )
    return TokenCreated(**TokenOut.model_validate(row).model_dump(), token=secret)


@router.route(
    "GET",
    "/api/v1/tokens",
    summary="List tokens",
    roles=ADMIN,
    query=TokenQuery,
    response=TokenList,
    tag="tokens",
    use_case=workflows.tokens,
)
async def list_tokens(req: ApiRequest, tokens: Tokens) -> TokenList:
    """Tokens, oldest first, paginated (never their secrets or hashes). Revoked and expired
    tokens are listed until the token purge removes them."""
    return await listing.listed(req, TokenList, tokens.list)


@router.route(
    "DELETE",
    "/api/v1/tokens/{id}",
    summary="Revoke a token",
    roles=ADMIN,
    response=TokenOut,
    tag="tokens",
    errors=(404, 409),
    use_case=workflows.tokens,
)
async def delete_token(req: ApiRequest, tokens: Tokens) -> TokenOut:
    """Revoke a token at once. Revoking the token in use by this very request is refused."""
    row = await tokens.revoke(
        req.params["id"], actor=req.actor, caller_token_id=req.require_principal().token_id
    )
    return TokenOut.model_validate(row)


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
