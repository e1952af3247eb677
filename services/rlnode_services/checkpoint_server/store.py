"""What the checkpoint-server knows, built from the topics: every checkpoint and weight
version, and a summary of every job (status, progress) for `rlnode job list|status`."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Column, Text
from sqlmodel import Field, SQLModel

from rlnode.messages import utc_now
from rlnode.service.db import UTCDateTime


class CheckpointRecord(SQLModel, table=True):
    __tablename__ = "checkpoints"

    job_id: str = Field(primary_key=True, max_length=128)
    step: int = Field(primary_key=True)
    org_id: str = Field(max_length=128, index=True)
    uri: str = Field(max_length=4096)
    final: bool = False
    created_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False)
    )

    @property
    def model(self) -> str:
        return f"{self.job_id}@{self.step}"


class WeightRecord(SQLModel, table=True):
    __tablename__ = "weight_versions"

    job_id: str = Field(primary_key=True, max_length=128)
    version: int = Field(primary_key=True)
    org_id: str = Field(max_length=128, index=True)
    step: int
    uri: str = Field(max_length=4096)
    blake3: str = Field(max_length=64)
    size_bytes: int
    created_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False)
    )


class EvalRecord(SQLModel, table=True):
    """One evaluation round of a job (its `eval.completed` event): what `<job>@best` picks
    from."""

    __tablename__ = "evaluations"

    job_id: str = Field(primary_key=True, max_length=128)
    step: int = Field(primary_key=True)
    org_id: str = Field(max_length=128, index=True)
    version: int
    seeds: int
    samples_per_seed: int
    count: int
    failed: int
    reward_mean: float | None = None
    reward_std: float | None = None
    pass_at_1: float | None = None
    pass_at_k: float | None = None
    created_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False)
    )

    def listed(self) -> dict:
        return {
            "step": self.step,
            "version": self.version,
            "seeds": self.seeds,
            "samples_per_seed": self.samples_per_seed,
            "count": self.count,
            "failed": self.failed,
            "reward_mean": self.reward_mean,
            "reward_std": self.reward_std,
            "pass_at_1": self.pass_at_1,
            "pass_at_k": self.pass_at_k,
            "created_at": self.created_at.isoformat(),
        }


class JobSummary(SQLModel, table=True):
    __tablename__ = "job_summaries"

    job_id: str = Field(primary_key=True, max_length=128)
    org_id: str = Field(max_length=128, index=True)
    status: str = Field(
        max_length=16
    )  # accepted|queued|running|paused|completed|failed|rejected|cancelled
    step: int = 0
    total_steps: int | None = None
    reward_mean: float | None = None
    loss: float | None = None
    reason: str | None = Field(default=None, max_length=2000)
    created_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False)
    )
    updated_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False)
    )


class JobDescription(SQLModel, table=True):
    """What a job is (from its `job.accepted`): its label, model, Task App and loss."""

    __tablename__ = "job_descriptions"

    job_id: str = Field(primary_key=True, max_length=128)
    org_id: str = Field(max_length=128, index=True)
    name: str | None = Field(default=None, max_length=200)
    model: str | None = Field(default=None, max_length=1024)
    task_app: str | None = Field(default=None, max_length=200)
    algorithm: str | None = Field(default=None, max_length=32)


class RolloutSampleRecord(SQLModel, table=True):
    """One episode of a step's `rollout.sample`, as text (`episode`: the EpisodeSample's
    JSON)."""

    __tablename__ = "rollout_samples"

    job_id: str = Field(primary_key=True, max_length=128)
    step: int = Field(primary_key=True)
    position: int = Field(primary_key=True)
    org_id: str = Field(max_length=128, index=True)
    reward: float | None = None
    status: str = Field(max_length=16)
    failure_kind: str | None = Field(default=None, max_length=64)
    episode: str = Field(sa_column=Column(Text(), nullable=False))
    created_at: datetime = Field(
        default_factory=utc_now, sa_column=Column(UTCDateTime(), nullable=False)
    )


TABLES = (
    CheckpointRecord,
    WeightRecord,
    EvalRecord,
    JobSummary,
    JobDescription,
    RolloutSampleRecord,
)
