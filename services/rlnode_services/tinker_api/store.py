"""What the tinker-api remembers: sessions, training runs (models), their checkpoints and
sampling sessions, each its org's. Every lookup names the org: another org's id is not
found, whatever it is."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Column
from sqlmodel import Field, SQLModel

from rlnode.messages import utc_now
from rlnode.service.db import UTCDateTime


def _now_column() -> Column:
    return Column(UTCDateTime(), nullable=False)


class TinkerSession(SQLModel, table=True):
    __tablename__ = "tinker_sessions"

    session_id: str = Field(primary_key=True, max_length=64)
    org_id: str = Field(max_length=128, index=True)
    user_metadata: str = Field(default="{}", description="JSON, as the client sent it")
    finished: str | None = Field(default=None, max_length=32, description="how it ended")
    created_at: datetime = Field(default_factory=utc_now, sa_column=_now_column())
    last_seen: datetime = Field(default_factory=utc_now, sa_column=_now_column())


class TinkerModel(SQLModel, table=True):
    """A training run: the SDK's model id (`{session}:train:{n}`) and the rlnode job it is."""

    __tablename__ = "tinker_models"

    model_id: str = Field(primary_key=True, max_length=200)
    org_id: str = Field(max_length=128, index=True)
    session_id: str = Field(max_length=64, index=True)
    job_id: str = Field(max_length=128, unique=True)
    base_model: str = Field(max_length=1000, description="as the client named it")
    source: str = Field(max_length=1000, description="the model source the learner loads")
    lora_rank: int | None = None
    lora_config: str | None = Field(default=None, description="LoraConfig JSON, as sent")
    user_metadata: str = Field(default="{}")
    # The next internal sequence number to publish (the learner's order of the run's calls).
    next_seq: int = 0
    steps: int = 0
    created_at: datetime = Field(default_factory=utc_now, sa_column=_now_column())
    last_request: datetime = Field(default_factory=utc_now, sa_column=_now_column())


class TinkerCheckpoint(SQLModel, table=True):
    """`tinker://{model_id}/{weights|sampler_weights}/{name}`."""

    __tablename__ = "tinker_checkpoints"

    tinker_path: str = Field(primary_key=True, max_length=400)
    org_id: str = Field(max_length=128, index=True)
    model_id: str = Field(max_length=200, index=True)
    kind: str = Field(max_length=16, description="training | sampler")
    name: str = Field(max_length=128)
    uri: str = Field(max_length=2000, description="file:// URI in the checkpoint store")
    weight_version: int | None = None
    size_bytes: int | None = None
    user_metadata: str | None = None
    created_at: datetime = Field(default_factory=utc_now, sa_column=_now_column())


class TinkerSampler(SQLModel, table=True):
    """A sampling session: the base model alone, or one weight version of one run."""

    __tablename__ = "tinker_samplers"

    sampler_id: str = Field(primary_key=True, max_length=200)
    org_id: str = Field(max_length=128, index=True)
    session_id: str = Field(max_length=64, index=True)
    base_model: str = Field(max_length=1000)
    source: str = Field(max_length=1000)
    model_path: str | None = Field(default=None, max_length=400)
    job_id: str | None = Field(default=None, max_length=128)
    weight_version: int | None = None
    uri: str | None = Field(default=None, max_length=2000)
    created_at: datetime = Field(default_factory=utc_now, sa_column=_now_column())


TABLES = (TinkerSession, TinkerModel, TinkerCheckpoint, TinkerSampler)
