"""The Task App contract, wire-compatible with Synth's public SDK (synth_ai/task/contracts.py;
docs/architecture.md §8): the bodies of `/health`, `/info`, `/task_info` and `/rollout`.

Requests we send carry every field that SDK requires. Responses we read are parsed
leniently (unknown fields kept, optional ones defaulted) because Task Apps are user code
and several SDK versions exist; then they are normalised (`NormalisedRollout`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

API_KEY_HEADER = "X-API-Key"


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class RolloutEnvSpec(Lenient):
    env_id: str | None = None
    env_name: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    seed: int | None = None


class PolicyConfig(Lenient):
    """What the Task App needs to ask the policy for actions."""

    inference_url: str = Field(
        description="Base URL; the app POSTs <inference_url>/v1/chat/completions."
    )
    model: str = "policy"
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None


class RolloutPolicySpec(Lenient):
    policy_id: str | None = None
    policy_name: str | None = None
    config: PolicyConfig


class RolloutRecordConfig(Lenient):
    trajectories: bool = True
    logprobs: bool = False
    value: bool = False
    return_trace: bool = False
    trace_format: Literal["compact", "full"] = "compact"


class RolloutSafetyConfig(Lenient):
    max_ops: int = 100_000
    max_time_s: float = 3600.0


class RolloutRequest(Lenient):
    run_id: str = Field(min_length=1, max_length=200)
    env: RolloutEnvSpec
    policy: RolloutPolicySpec
    ops: list[str] | list[dict[str, Any]] = Field(default_factory=lambda: ["agent", "env"])
    record: RolloutRecordConfig = Field(default_factory=RolloutRecordConfig)
    on_done: str = "reset"
    safety: RolloutSafetyConfig = Field(default_factory=RolloutSafetyConfig)
    training_session_id: str | None = None
    mode: Literal["rl", "eval"] = "rl"


class RolloutStep(Lenient):
    obs: dict[str, Any] = Field(default_factory=dict)
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    reward: float | None = None
    done: bool = False
    truncated: bool | None = None
    info: dict[str, Any] | None = None

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("a step reward must be a finite number")
        return value


class RolloutTrajectory(Lenient):
    env_id: str = "env"
    policy_id: str = "policy"
    steps: list[RolloutStep]
    final: dict[str, Any] | None = None
    length: int = 0


class RolloutMetrics(Lenient):
    episode_returns: list[float] = Field(default_factory=list)
    mean_return: float | None = None
    num_steps: int = 0
    num_episodes: int = 0
    outcome_score: float | None = None
    events_score: float | None = None
    details: dict[str, Any] = Field(default_factory=dict)


class RolloutResponse(Lenient):
    run_id: str
    trajectories: list[RolloutTrajectory]
    branches: dict[str, list[str]] = Field(default_factory=dict)
    metrics: RolloutMetrics = Field(default_factory=RolloutMetrics)
    aborted: bool = False
    ops_executed: int = 0
    trace: dict[str, Any] | None = None


class HealthResponse(Lenient):
    healthy: bool


class TaskInfo(Lenient):
    """One task (seed) as `/task_info` describes it (the fields Synth's SDK requires)."""

    task: dict[str, Any]
    environments: list[str]
    action_space: dict[str, Any] = Field(default_factory=dict)
    observation: dict[str, Any] = Field(default_factory=dict)
    dataset: dict[str, Any] = Field(default_factory=dict)
    rubric: dict[str, Any] = Field(default_factory=dict)
    inference: dict[str, Any] = Field(default_factory=dict)
    capabilities: dict[str, Any] = Field(default_factory=dict)
    limits: dict[str, Any] = Field(default_factory=dict)


class InfoResponse(Lenient):
    service: dict[str, Any]
    dataset: dict[str, Any] = Field(default_factory=dict)
    capabilities: dict[str, Any] = Field(default_factory=dict)
    limits: dict[str, Any] = Field(default_factory=dict)


class NormalisedRollout(BaseModel):
    """What rlnode takes from a RolloutResponse: the episode return, the per-step rewards
    in order, and the outcome, whichever of the optional fields the Task App filled in."""

    run_id: str
    reward: float
    step_rewards: list[float]
    outcome_score: float | None
    num_steps: int
    aborted: bool
    metrics: dict[str, float]

    @classmethod
    def from_response(cls, response: RolloutResponse) -> NormalisedRollout:
        steps = [s for t in response.trajectories for s in t.steps]
        step_rewards = [float(s.reward) for s in steps if s.reward is not None]
        m = response.metrics
        if m.episode_returns:
            reward = float(sum(m.episode_returns) / len(m.episode_returns))
        elif m.mean_return is not None:
            reward = float(m.mean_return)
        elif m.outcome_score is not None:
            reward = float(m.outcome_score)
        elif step_rewards:
            reward = float(sum(step_rewards))
        else:
            raise ValueError(
                "the rollout reports no reward: no episode_returns, mean_return, outcome_score or step reward"
            )
        if not math.isfinite(reward):
            raise ValueError("the rollout's reward is not a finite number")
        numbers = {
            k: float(v)
            for k, v in m.details.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
        return cls(
            run_id=response.run_id,
            reward=reward,
            step_rewards=step_rewards,
            outcome_score=m.outcome_score,
            num_steps=m.num_steps or len(steps),
            aborted=response.aborted,
            metrics=numbers,
        )
