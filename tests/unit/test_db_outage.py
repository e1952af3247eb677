"""A database outage, without a database: what a request, /health and a bus handler make of
the errors SQLAlchemy raises when the server is gone (tests/chaos/test_db_outage.py
stops a real one)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import exc

from rlnode.bus import Retryable
from rlnode.service.app import create_service_app
from rlnode.service.db import make_engine
from rlnode.service.db_outage import retry_on_outage, unreachable, watch_database
from rlnode.service.http import install_error_handlers
from rlnode.service.registry import GATEWAY
from rlnode.service.settings import ServiceSettings

REFUSED = exc.OperationalError(
    "SELECT secret FROM t WHERE token = 'tk-do-not-show'",
    {"token": "tk-do-not-show"},
    Exception('connection failed: connection to server at "127.0.0.1" failed: Connection refused'),
)
DUPLICATE = exc.IntegrityError("INSERT", {}, Exception("duplicate key"))


def test_only_connection_failures_count_as_an_outage() -> None:
    assert unreachable(REFUSED) and unreachable(exc.TimeoutError("pool exhausted"))
    assert not unreachable(DUPLICATE) and not unreachable(ValueError("x"))


def test_a_request_meeting_an_outage_answers_503_without_the_statement() -> None:
    app = create_service_app(GATEWAY, ServiceSettings(port=0))
    install_error_handlers(app)

    @app.get("/down")
    def down() -> None:
        raise REFUSED

    @app.get("/bug")
    def bug() -> None:
        raise DUPLICATE

    client = TestClient(app, raise_server_exceptions=False)
    response = client.get("/down")
    assert response.status_code == 503 and response.headers["Retry-After"] == "5"
    detail = response.json()["detail"]
    assert detail == (
        'the database is unreachable: connection failed: connection to server at "127.0.0.1" '
        "failed: Connection refused; retry in a few seconds"
    )
    assert client.get("/bug").status_code == 500  # a bug stays a bug


def test_health_says_degraded_while_the_database_does_not_answer() -> None:
    app = create_service_app(GATEWAY, ServiceSettings(port=0))
    watch_database(app, make_engine("postgresql://nobody@127.0.0.1:9/none"))
    report = TestClient(app).get("/health").json()
    assert report["status"] == "degraded" and report["checks"] == {"database": False}


async def test_a_handler_meeting_an_outage_is_retryable_and_a_bug_is_not() -> None:
    async def handler(error: Exception) -> None:
        raise error

    with pytest.raises(Retryable, match="the database is unreachable"):
        await retry_on_outage(handler)(REFUSED)
    with pytest.raises(exc.IntegrityError):
        await retry_on_outage(handler)(DUPLICATE)
