"""Who may call the checkpoint-server's routes: org tokens only (checkpoints belong to an
org), each route with its scope."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends

from rlnode.service.auth import AuthError, Scope, TokenClaims, TokenVerifier
from rlnode.service.http import caller_claims


async def caller(claims: Annotated[TokenClaims, Depends(caller_claims)]) -> TokenClaims:
    if claims.org_id is None:
        raise AuthError(403, "use an org token: checkpoints belong to an org")
    return claims


Caller = Annotated[TokenClaims, Depends(caller)]


def org_of(claims: TokenClaims) -> str:
    assert claims.org_id is not None  # `caller` admits org tokens only
    return claims.org_id


def need(claims: TokenClaims, scope: Scope) -> None:
    TokenVerifier.authorize_claims(claims, scopes=[scope])
