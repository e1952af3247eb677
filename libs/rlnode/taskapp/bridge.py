"""Between the bus's records and the Task App contract: the `RolloutRequest` a work item
becomes, and the `Trajectory` that a rollout's recorded turns and the Task App's outcome
(or the reason it failed) become. The rollout-generator and the in-process generator both
build their rollouts here, so the two cannot drift apart."""

from __future__ import annotations

import time
from typing import Any

from rlnode.messages import RolloutFailure, RolloutWork, TokenTurn, Trajectory
from rlnode.taskapp.contract import (
    NormalisedRollout,
    PolicyConfig,
    RolloutEnvSpec,
    RolloutPolicySpec,
    RolloutRequest,
    RolloutSafetyConfig,
)


def rollout_request(work: RolloutWork, rollout_id: str, inference_url: str) -> RolloutRequest:
    """What the Task App is asked to run for `work`, calling back `inference_url`."""
    return RolloutRequest(
        run_id=rollout_id,
        env=RolloutEnvSpec(
            env_name=work.task_app.env_name, seed=work.seed, config=work.task_app.env_config
        ),
        policy=RolloutPolicySpec(
            policy_id=f"{work.job_id}@{work.policy_version}",
            config=PolicyConfig(
                inference_url=inference_url,
                model=work.job_id,
                max_tokens=work.sampling.max_tokens,
                temperature=work.sampling.temperature,
                top_p=work.sampling.top_p,
            ),
        ),
        safety=RolloutSafetyConfig(max_time_s=work.task_app.rollout_timeout_s),
        training_session_id=work.job_id,
        mode="eval" if work.mode == "eval" else "rl",
    )


def trajectory(
    work: RolloutWork,
    sample_index: int,
    rollout_id: str,
    generator: str,
    started: float,
    turns: list[TokenTurn],
    outcome: NormalisedRollout | None = None,
    failure: RolloutFailure | None = None,
) -> Trajectory:
    """The trajectory of sample `sample_index` of `work`: ok with the outcome's rewards, or
    failed with why. An outcome without any recorded turn is a failure: the Task App never
    asked the policy. `started` is the rollout's `time.monotonic()` start."""
    fields: dict[str, Any]
    if failure is None and outcome is not None and not turns:
        failure = RolloutFailure(
            kind="task_app_invalid_response", message="the Task App never called the inference URL"
        )
    if failure is None and outcome is not None:
        fields = {
            "status": "ok",
            "reward": outcome.reward,
            "step_rewards": outcome.step_rewards,
            "metrics": outcome.metrics,
        }
    else:
        fields = {
            "status": "failed",
            "failure": failure or RolloutFailure(kind="internal", message="no outcome"),
        }
    return Trajectory(
        job_id=work.job_id,
        org_id=work.org_id,
        work_id=work.sample_id(sample_index),
        rollout_id=rollout_id,
        generator=generator,
        step=work.step,
        group_id=work.group_id,
        seed=work.seed,
        sample_index=sample_index,
        mode=work.mode,
        duration_s=time.monotonic() - started,
        turns=turns,
        **fields,
    )
