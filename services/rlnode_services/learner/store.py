"""The learner's record of jobs, so a restarted learner resumes what it owned."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Column
from sqlmodel import Field, SQLModel

from rlnode.messages import utc_now
from rlnode.service.db import UTCDateTime


class JobRecord(SQLModel, table=True):
    __tablename__ = "learner_jobs"

    job_id: str = Field(primary_key=True, max_length=128)
    org_id: str = Field(max_length=128, index=True)
    config: str = Field(description="JobConfig as JSON")
    status: str = Field(
        max_length=16, description="queued | running | completed | failed | cancelled"
    )
    step: int = 0
    reason: str | None = Field(default=None, max_length=2000)
    created_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False)
    )
    updated_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False)
    )


class UsedJobToken(SQLModel, table=True):
    """Job tokens the learner has taken: each is good for one request (a copy read off the
    job-requests topic and published again is refused)."""

    __tablename__ = "learner_used_job_tokens"

    token_id: str = Field(primary_key=True, max_length=64)
    job_id: str = Field(max_length=128)
    request_id: str = Field(max_length=64)
    expires_at: datetime = Field(sa_column=Column(UTCDateTime(), nullable=False, index=True))


TABLES = (JobRecord, UsedJobToken)
ACTIVE = ("queued", "running")
