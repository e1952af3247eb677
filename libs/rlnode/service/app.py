"""What every service process shares: a FastAPI app with a health endpoint, logging, and a
uvicorn server that stops cleanly on SIGTERM/SIGINT (in-flight requests finish, lifespan
shutdown runs, exit code 0)."""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from rlnode import __version__
from rlnode.service.auth import TOKEN_PATTERN, redact_tokens
from rlnode.service.files import make_private, private_dir
from rlnode.service.registry import ServiceSpec
from rlnode.service.settings import ServiceSettings
from rlnode.service.stacks import install_stack_dump

S = TypeVar("S", bound=ServiceSettings)


class StartupError(RuntimeError):
    """A service cannot start (bad key, unreachable dependency): the message says why and
    what to do; the process exits 2 without a traceback."""


class RedactTokens(logging.Filter):
    """Blanks out rlnode tokens in every log line, wherever a message or an exception put
    one (a refused request may quote what it was sent)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if TOKEN_PATTERN.search(message):
            record.msg, record.args = redact_tokens(message), None
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = redact_tokens(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


def configure_logging(service: str, level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"
    )
    redact_log_handlers()


def redact_log_handlers() -> None:
    """Every handler of the root and uvicorn's loggers blanks tokens out."""
    for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactTokens) for f in handler.filters):
                handler.addFilter(RedactTokens())


def create_service_app(
    spec: ServiceSpec, settings: ServiceSettings, **fastapi_args: Any
) -> FastAPI:
    """The app a service builds its routes on. Its health route answers while the process
    serves; services add their own checks to `app.state.health_checks` (name -> callable
    returning True when healthy, or a coroutine function for one that does I/O: a failing
    one makes it "degraded"), and the background work
    whose death must not go unnoticed to `app.state.failures` (callables returning
    {what: why} for what is down: then /health answers 503 naming it)."""
    service = spec.name
    # No /docs or /redoc: every route but /health needs a token, and those pages fetch their
    # scripts from a CDN. /openapi.json stays: it is the API's shape, public in the repo.
    app = FastAPI(
        title=f"rlnode {service}",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        **fastapi_args,
    )
    app.state.settings = settings
    app.state.service = service
    app.state.started_at = time.monotonic()
    health_checks: dict[str, Callable[[], bool | Awaitable[bool]]] = {}
    app.state.health_checks = health_checks
    failures: list[Callable[[], dict[str, str]]] = []
    app.state.failures = failures
    # What a service says of its mode beside its checks (name -> callable giving a JSON value).
    health_info: dict[str, Callable[[], Any]] = {}
    app.state.health_info = health_info

    @app.get(spec.health_path, tags=["ops"], summary="Liveness and readiness of this service")
    async def health() -> JSONResponse:
        checks = {name: await _passes(check) for name, check in app.state.health_checks.items()}
        failing = {what: why for report in app.state.failures for what, why in report().items()}
        status = "failing" if failing else "ok" if all(checks.values()) else "degraded"
        body = {
            "status": status,
            "service": service,
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - app.state.started_at, 3),
            "checks": checks,
        }
        if failing:
            body["failing"] = failing
        if app.state.health_info:
            body["info"] = {name: info() for name, info in app.state.health_info.items()}
        return JSONResponse(body, status_code=503 if failing else 200)

    return app


async def _passes(check: Callable[[], bool | Awaitable[bool]]) -> bool:
    result = check()
    return bool(await result) if inspect.isawaitable(result) else bool(result)


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM after a graceful stop, so a clean stop looks like a kill
    (exit -15) to a supervisor. Here a stop that went well exits 0."""

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def serve(spec: ServiceSpec, settings_type: type[S], app_factory: Callable[[S], FastAPI]) -> int:
    """Entry point body of a service: read settings, build the app, serve until signalled."""
    service = spec.name
    make_private()
    try:
        settings = settings_type()
    except ValidationError as e:
        from rlnode.messages.codec import describe_validation_error

        print(
            f"{service}: bad settings: {describe_validation_error(e, 'settings')}", file=sys.stderr
        )
        return 2
    configure_logging(service, settings.log_level)
    install_stack_dump()
    private_dir(settings.node.data_dir)
    try:
        app = app_factory(settings)
    except StartupError as e:
        print(f"{service}: cannot start: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
        lifespan="on",
    )
    redact_log_handlers()  # uvicorn's own handlers exist from here
    server = _GracefulServer(config)
    server.run()
    # uvicorn leaves `started` False when it could not bind or the lifespan startup failed.
    return 0 if server.started else 1
