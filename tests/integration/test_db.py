"""The database helpers on SQLite and, where it answers, PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import Column, exc
from sqlmodel import Field, SQLModel, select

from rlnode.service.db import UTCDateTime, create_tables, engine_for, make_engine, session_scope
from rlnode.service.settings import DatabaseSettings


class Sample(SQLModel, table=True):
    __tablename__ = "rlnode_test_sample"
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(unique=True)
    at: datetime = Field(sa_column=Column(UTCDateTime(), nullable=False))


def test_rows_and_aware_timestamps_round_trip(database_url: str) -> None:
    engine = make_engine(database_url)
    create_tables(engine, Sample)
    moment = datetime(2026, 11, 30, 12, 0, tzinfo=timezone(timedelta(hours=2)))
    with session_scope(engine) as session:
        session.add(Sample(name="a", at=moment))
    with session_scope(engine) as session:
        row = session.exec(select(Sample).where(Sample.name == "a")).one()
    assert row.at == moment and row.at.tzinfo is not None
    assert row.at.utcoffset() == timedelta(0)
    engine.dispose()


def test_a_failed_transaction_leaves_nothing(database_url: str) -> None:
    engine = make_engine(database_url)
    create_tables(engine, Sample)
    now = datetime.now(UTC)
    with session_scope(engine) as session:
        session.add(Sample(name="first", at=now))
    with pytest.raises(exc.IntegrityError), session_scope(engine) as session:
        session.add(Sample(name="second", at=now))
        session.add(Sample(name="first", at=now))  # unique violation
    with session_scope(engine) as session:
        assert [r.name for r in session.exec(select(Sample))] == ["first"]
    engine.dispose()


def test_naive_datetimes_are_refused(database_url: str) -> None:
    engine = make_engine(database_url)
    create_tables(engine, Sample)
    with (
        pytest.raises(exc.StatementError, match="naive datetime"),
        session_scope(engine) as session,
    ):
        session.add(Sample(name="naive", at=datetime(2026, 1, 1)))
        session.flush()
    engine.dispose()


def test_default_engine_is_sqlite_under_the_data_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("RLNODE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    engine = engine_for("learner")
    create_tables(engine, Sample)
    assert (tmp_path / "db" / "learner.sqlite3").is_file()
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    engine.dispose()


def test_unsupported_backends_are_named() -> None:
    with pytest.raises(ValueError, match="unsupported DATABASE_URL backend 'mysql'"):
        make_engine("mysql://u@h/d")
    assert DatabaseSettings(DATABASE_URL="postgresql://x@y/z").url_for("s") == "postgresql://x@y/z"
