"""Rollout work (learner -> generators) and trajectories (generators -> learner)."""

from __future__ import annotations

from typing import ClassVar, Literal
from uuid import UUID

from pydantic import (
    Field,
    FiniteFloat,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    model_validator,
)

from rlnode.messages.base import Envelope, StrictModel
from rlnode.messages.config import ModelSpec, SamplingSpec, TaskAppSpec

# "train": a rollout of a training batch; "eval": of a held-out evaluation round, run with
# the Task App's mode "eval" and never trained on.
RolloutMode = Literal["train", "eval"]


class RolloutWork(Envelope):
    """One rollout to run: sample `sample_index` of the group for `seed` in training `step`."""

    SCHEMA: ClassVar[Literal["rlnode.RolloutWork/1"]] = "rlnode.RolloutWork/1"
    schema_: Literal["rlnode.RolloutWork/1"] = Field(SCHEMA, alias="schema")

    step: NonNegativeInt = Field(description="The training step whose batch this belongs to.")
    policy_version: NonNegativeInt = Field(description="Newest policy version when issued.")
    group_id: str = Field(min_length=1, max_length=200)
    seed: int
    sample_index: NonNegativeInt
    group_size: PositiveInt
    model: ModelSpec
    task_app: TaskAppSpec
    sampling: SamplingSpec
    mode: RolloutMode = "train"

    @model_validator(mode="after")
    def _index_in_group(self) -> RolloutWork:
        if self.sample_index >= self.group_size:
            raise ValueError(
                f"sample_index {self.sample_index} is outside a group of {self.group_size}"
            )
        return self


class TokenTurn(StrictModel):
    """One inference call of an episode, exactly as the engine saw and sampled it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float] = Field(description="Sampling logprob of each completion token.")
    ref_logprobs: list[float] | None = Field(
        None, description="Reference-model logprobs, when the reference is stacked on inference."
    )
    policy_version: NonNegativeInt
    finish_reason: Literal["stop", "length", "abort"]

    @model_validator(mode="after")
    def _aligned(self) -> TokenTurn:
        n = len(self.completion_ids)
        if len(self.logprobs) != n:
            raise ValueError(f"{len(self.logprobs)} logprobs for {n} completion tokens")
        if self.ref_logprobs is not None and len(self.ref_logprobs) != n:
            raise ValueError(f"{len(self.ref_logprobs)} ref_logprobs for {n} completion tokens")
        return self


FailureKind = Literal[
    "task_app_unreachable",
    "task_app_auth_refused",
    "task_app_error",
    "task_app_invalid_response",
    "timeout",
    "inference_error",
    "cancelled",
    "internal",
]


class RolloutFailure(StrictModel):
    kind: FailureKind
    message: str = Field(max_length=10_000)


class Trajectory(Envelope):
    """The outcome of one `RolloutWork`: the recorded turns joined with the Task App's rewards,
    or the classified reason it failed. Failed rollouts are published too, never dropped."""

    SCHEMA: ClassVar[Literal["rlnode.Trajectory/1"]] = "rlnode.Trajectory/1"
    schema_: Literal["rlnode.Trajectory/1"] = Field(SCHEMA, alias="schema")

    work_id: UUID
    rollout_id: str = Field(min_length=1, max_length=200)
    generator: str = Field(min_length=1, max_length=200)
    step: NonNegativeInt
    group_id: str = Field(min_length=1, max_length=200)
    seed: int
    sample_index: NonNegativeInt
    mode: RolloutMode = "train"
    status: Literal["ok", "failed"]
    turns: list[TokenTurn] = Field(default_factory=list)
    reward: FiniteFloat | None = Field(None, description="Episode return.")
    step_rewards: list[FiniteFloat] = Field(default_factory=list)
    metrics: dict[str, FiniteFloat] = Field(default_factory=dict)
    failure: RolloutFailure | None = None
    duration_s: NonNegativeFloat = 0.0

    @model_validator(mode="after")
    def _status_consistent(self) -> Trajectory:
        if self.status == "ok":
            if self.failure is not None:
                raise ValueError("an 'ok' trajectory carries no failure")
            if self.reward is None:
                raise ValueError("an 'ok' trajectory needs a reward")
            if not self.turns:
                raise ValueError("an 'ok' trajectory needs at least one turn")
        elif self.failure is None:
            raise ValueError("a 'failed' trajectory needs a failure saying why")
        return self

    @property
    def policy_versions(self) -> tuple[int, int] | None:
        """(oldest, newest) policy version used across the turns."""
        if not self.turns:
            return None
        versions = [t.policy_version for t in self.turns]
        return min(versions), max(versions)
