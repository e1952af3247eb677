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


TABLES = (JobRecord,)
ACTIVE = ("queued", "running")
