"""HTTP plumbing every rlnode API shares: error bodies that say what was wrong without
echoing what was sent, and a request-size limit."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

import orjson
from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlnode.service.auth import AuthError, TokenClaims, bearer_token, require_operator
from rlnode.service.db_outage import install_outage_handler

log = logging.getLogger("rlnode.service.http")


async def caller_claims(
    request: Request, authorization: Annotated[str | None, Header()] = None
) -> TokenClaims:
    """The verified token of the caller (`app.state.verifier` checks it): 401 without one.
    On the event loop: a thread only when the verifier has HTTP to do (the vault's key, a
    stale revocation list), not a thread-pool hop on every request."""
    verifier = request.app.state.verifier
    if verifier.needs_refresh():
        await asyncio.to_thread(verifier.refresh)
    return verifier.verify(bearer_token(authorization))


async def operator_claims(claims: Annotated[TokenClaims, Depends(caller_claims)]) -> TokenClaims:
    return require_operator(claims)


Caller = Annotated[TokenClaims, Depends(caller_claims)]


def json_response(content: Any) -> Response:
    """JSON bytes straight from orjson, for the routes every rollout passes through: FastAPI's
    response validation and encoding would check again what the route just built."""
    return Response(orjson.dumps(content), media_type="application/json")


Operator = Annotated[TokenClaims, Depends(operator_claims)]


def describe_request_errors(errors: list[dict[str, Any]], limit: int = 8) -> str:
    """`body.name: String should match pattern ...; ...`, never the input values (a request
    may carry a credential in any field)."""
    parts = []
    for item in errors[:limit]:
        where = ".".join(str(p) for p in item.get("loc", ())) or "request"
        message = str(item.get("msg", "invalid"))
        parts.append(f"{where}: {message.removeprefix('Value error, ')}")
    if len(errors) > limit:
        parts.append(f"... and {len(errors) - limit} more")
    return "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    install_outage_handler(app)  # a database that is down: 503, not 500

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(
            status_code=422, content={"detail": describe_request_errors(list(exc.errors()))}
        )

    @app.exception_handler(AuthError)
    async def _auth(_request: Request, exc: AuthError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(
            status_code=exc.status, content={"detail": exc.message}, headers=headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error(
            "unhandled %s on %s %s",
            type(exc).__name__,
            request.method,
            request.url.path,
            exc_info=exc,
        )
        return JSONResponse(
            status_code=500, content={"detail": "internal error; see the service log"}
        )


class BodySizeLimit:
    """Refuses request bodies over `max_bytes` with 413, whether or not Content-Length says so."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = f'{{"detail":"request body larger than {self.max_bytes} bytes"}}'.encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _TooLarge(HTTPException):
    # An HTTPException, so FastAPI's body parsing passes it on as a 413 (it turns other
    # exceptions raised while reading the body into a 400).
    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body larger than {max_bytes} bytes")
