"""Rollout work (learner -> generators) and trajectories (generators -> learner)."""

from __future__ import annotations

from typing import ClassVar, Literal
from uuid import UUID, uuid5

from pydantic import (
    Field,
    FiniteFloat,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    model_validator,
)

from rlnode.messages.base import Envelope, StrictModel
from rlnode.messages.config import LoraSpec, ModelSpec, SamplingSpec, TaskAppSpec

# "train": a rollout of a training batch; "eval": of a held-out evaluation round, run with
# the Task App's mode "eval" and never trained on.
RolloutMode = Literal["train", "eval"]

# Namespace of the samples' ids (`RolloutWork.sample_id`): the learner's work ids from when
# a work item held one sample, so a job's sample ids stayed what they were.
SAMPLE_NAMESPACE = UUID("5f0c1c2e-7d0b-4a3e-9a55-2b8f3c1e9d10")
MAX_SAMPLES_PER_WORK = 1024


class RolloutWork(Envelope):
    """Rollouts to run: samples `sample_index` .. `sample_index + samples - 1` of the group
    for `seed` in training `step`. A generator runs them together (one call to the gateway,
    one record in and out of the broker for the lot) and publishes a trajectory per sample;
    each sample fails or succeeds alone."""

    SCHEMA: ClassVar[Literal["rlnode.RolloutWork/2"]] = "rlnode.RolloutWork/2"
    schema_: Literal["rlnode.RolloutWork/2"] = Field(SCHEMA, alias="schema")

    step: NonNegativeInt = Field(description="The training step whose batch this belongs to.")
    policy_version: NonNegativeInt = Field(description="Newest policy version when issued.")
    group_id: str = Field(min_length=1, max_length=200)
    seed: int
    sample_index: NonNegativeInt = Field(description="The first sample of the group here.")
    samples: PositiveInt = Field(
        1,
        le=MAX_SAMPLES_PER_WORK,
        description="How many of the group's samples, from sample_index.",
    )
    group_size: PositiveInt
    model: ModelSpec
    task_app: TaskAppSpec
    sampling: SamplingSpec
    mode: RolloutMode = "train"
    lora: LoraSpec | None = Field(
        None,
        description="The job trains LoRA adapters: its weight versions are adapters, and a vLLM "
        "engine for it starts with adapter support of this rank.",
    )

    @model_validator(mode="after")
    def _index_in_group(self) -> RolloutWork:
        if self.sample_index + self.samples > self.group_size:
            raise ValueError(
                f"samples {self.sample_index}..{self.sample_index + self.samples - 1} are "
                f"outside a group of {self.group_size}"
            )
        return self

    @property
    def key(self) -> bytes:
        """Keyed by job and group, not by job alone (docs/decisions.md): a job's work spreads
        over the topic's partitions and so over every generator of the consumer group, while
        a group's samples stay together (one engine, its prefix cache)."""
        return f"{self.job_id}/{self.group_id}".encode()

    @property
    def sample_indices(self) -> range:
        return range(self.sample_index, self.sample_index + self.samples)

    def sample_id(self, sample_index: int) -> UUID:
        """The id of one sample's trajectory (`Trajectory.work_id`): the job, the group and
        the index, so that work issued again after a restart, however it is split into
        items, is recognised as the same."""
        return sample_id(self.job_id, self.group_id, sample_index)

    def split(self, samples_per_work: int) -> list[RolloutWork]:
        """These samples as items of at most `samples_per_work`, as even as they come, each
        with an id of its own derived from the group's (deterministic, like sample ids)."""
        items = -(-self.samples // samples_per_work)
        base, extra = divmod(self.samples, items)
        parts, first = [], self.sample_index
        for i in range(items):
            count = base + (1 if i < extra else 0)
            key = f"{self.job_id}/{self.group_id}/{first}+{count}"
            parts.append(
                self.model_copy(
                    update={
                        "id": uuid5(SAMPLE_NAMESPACE, key),
                        "sample_index": first,
                        "samples": count,
                    }
                )
            )
            first += count
        return parts


def sample_id(job_id: str, group_id: str, sample_index: int) -> UUID:
    return uuid5(SAMPLE_NAMESPACE, f"{job_id}/{group_id}/{sample_index}")


class TokenTurn(StrictModel):
    """One inference call of an episode, exactly as the engine saw and sampled it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float] = Field(description="Sampling logprob of each completion token.")
    ref_logprobs: list[float] | None = Field(
        None, description="Reference-model logprobs, when the reference is stacked on inference."
    )
    policy_version: NonNegativeInt = Field(
        description="The weight version the turn's first token was sampled under."
    )
    last_policy_version: NonNegativeInt | None = Field(
        None,
        description="The version its last tokens were sampled under, when newer weights went "
        "in while it was generated (vLLM's in-flight swap); each logprob is that of the "
        "weights its token came from.",
    )
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

    work_id: UUID = Field(description="The sample's id: `RolloutWork.sample_id(sample_index)`.")
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
        versions += [t.last_policy_version for t in self.turns if t.last_policy_version is not None]
        return min(versions), max(versions)
