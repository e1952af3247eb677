"""Database access for the services that keep state: a SQLModel engine from DATABASE_URL,
SQLite under the data directory by default, PostgreSQL in production."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.types import DateTime, TypeDecorator
from sqlmodel import Session, SQLModel, create_engine

from rlnode.service.files import private_file
from rlnode.service.settings import DatabaseSettings, NodeSettings


class UTCDateTime(TypeDecorator):
    """A timezone-aware UTC datetime on every backend. SQLite keeps no offset, so values are
    stored as naive UTC there and given their zone back on the way out."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column; attach a timezone first")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def normalise_url(url: str) -> str:
    """Accept the common spellings: postgres:// and postgresql:// use psycopg 3."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def make_engine(url: str, *, echo: bool = False) -> Engine:
    url = normalise_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            # SQLite gives its -wal and -shm files the database file's mode.
            private_file(Path(parsed.database))
        engine = create_engine(url, echo=echo, connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if parsed.get_backend_name() == "postgresql":
        # Pre-ping: connections the server dropped (a restart) are replaced on checkout. A
        # connect timeout: a server that does not answer fails a request, never hangs it.
        timeout = {} if "connect_timeout" in parsed.query else {"connect_timeout": 10}
        return create_engine(url, echo=echo, pool_pre_ping=True, connect_args=timeout)
    raise ValueError(
        f"unsupported DATABASE_URL backend {parsed.get_backend_name()!r}; use postgresql:// or sqlite://"
    )


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers go on while a writer commits; foreign keys are off by default in SQLite.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def engine_for(
    service: str, settings: DatabaseSettings | None = None, node: NodeSettings | None = None
) -> Engine:
    settings = settings or DatabaseSettings()
    return make_engine(settings.url_for(service, node), echo=settings.echo_sql)


def create_tables(engine: Engine, *tables: Any) -> None:
    """Create the given SQLModel tables (all registered ones when none are named). Processes
    that share a database (a node's gateways) may start together: the one that loses the
    race to create a table finds it there when it looks again."""
    metadata = SQLModel.metadata
    chosen = [t.__table__ for t in tables] or None
    for attempt in range(3):
        try:
            metadata.create_all(engine, tables=chosen)
            return
        except DBAPIError:
            if attempt == 2:
                raise
            time.sleep(0.2 * (attempt + 1))


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    with Session(engine, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def redacted_url(url: str) -> str:
    return make_url(normalise_url(url)).render_as_string(hide_password=True)
