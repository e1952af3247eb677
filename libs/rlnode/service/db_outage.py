"""A database that is down is an outage, not a bug. While it lasts, a request that needs it
answers 503 saying so (never 500 with a traceback), /health reports the service "degraded"
with the database check failing, and a bus handler gets its record again after a pause
rather than dead-lettering it. Once the server is back, the engine's pre-ping replaces the
dead pooled connections: services recover by themselves, without a restart."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy import exc, text
from sqlalchemy.engine import Engine

from rlnode.bus.errors import Retryable

log = logging.getLogger("rlnode.service.db")
P = ParamSpec("P")
PROBE_TIMEOUT_S = 3.0


def unreachable(error: BaseException) -> bool:
    """Whether `error` says the database cannot be used just now (connection refused or
    dropped, server shutting down, no pooled connection free) rather than that a
    statement was wrong."""
    if isinstance(error, exc.TimeoutError):  # the pool had no connection to give
        return True
    if isinstance(error, exc.DBAPIError):
        return error.connection_invalidated or isinstance(
            error, exc.OperationalError | exc.InterfaceError
        )
    return False


def why(error: exc.SQLAlchemyError) -> str:
    """The driver's first line (never the statement or its parameters: they may hold
    secrets)."""
    original = getattr(error, "orig", None) or error
    return (str(original).strip().splitlines() or [type(original).__name__])[0]


def message(error: exc.SQLAlchemyError) -> str:
    return f"the database is unreachable: {why(error)}; retry in a few seconds"


def install_outage_handler(app: FastAPI) -> None:
    """Answer 503 for a request that failed because the database is down (other database
    errors stay 500s: they are bugs)."""

    async def _outage(request: Request, error: Exception) -> JSONResponse:
        if not unreachable(error):
            raise error  # the app's catch-all logs it and answers 500
        assert isinstance(error, exc.SQLAlchemyError)
        log.warning("%s %s: %s", request.method, request.url.path, message(error))
        return JSONResponse(
            status_code=503, content={"detail": message(error)}, headers={"Retry-After": "5"}
        )

    app.add_exception_handler(exc.DBAPIError, _outage)
    app.add_exception_handler(exc.TimeoutError, _outage)


def watch_database(app: FastAPI, engine: Engine) -> None:
    """/health checks the database ("database": false while it does not answer)."""

    def probe() -> bool:
        try:
            with engine.connect() as connection:
                connection.execute(text("SELECT 1"))
        except exc.SQLAlchemyError as e:
            if not unreachable(e):
                raise
            return False
        return True

    async def check() -> bool:
        try:
            return await asyncio.wait_for(asyncio.to_thread(probe), PROBE_TIMEOUT_S)
        except TimeoutError:
            return False

    app.state.health_checks["database"] = check


def retry_on_outage(
    handler: Callable[P, Awaitable[Any]],
) -> Callable[P, Awaitable[Any]]:
    """A bus handler whose database outages are `Retryable`: the subscription hands it the
    record again after a pause instead of dead-lettering it. The handler must be safe to
    run again on the same record."""

    @functools.wraps(handler)
    async def retrying(*args: P.args, **kwargs: P.kwargs) -> Any:
        try:
            return await handler(*args, **kwargs)
        except exc.SQLAlchemyError as e:
            if unreachable(e):
                raise Retryable(message(e)) from e
            raise

    return retrying
