"""Messages the unit tests build again and again, with the fields they vary as arguments."""

from __future__ import annotations

import uuid

from rlnode.messages import RolloutFailure, TokenTurn, Trajectory


def turn(prompt: list[int], completion: list[int], version: int = 0) -> TokenTurn:
    return TokenTurn(
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-0.1] * len(completion),
        policy_version=version,
        finish_reason="stop",
    )


def trajectory(
    *,
    seed: int = 0,
    sample: int = 0,
    reward: float | None = 1.0,
    turns: list[TokenTurn] | None = None,
    step: int = 0,
    group_id: str | None = None,
    mode: str = "train",
    failure: str = "timeout",
) -> Trajectory:
    """An ok trajectory with `reward`, or (reward None) a failed one of kind `failure`."""
    common = {
        "job_id": "j",
        "org_id": "o",
        "work_id": uuid.uuid4(),
        "rollout_id": f"r{seed}-{sample}",
        "generator": "g",
        "step": step,
        "group_id": group_id or f"{step}/{seed}",
        "seed": seed,
        "sample_index": sample,
        "mode": mode,
    }
    if reward is None:
        return Trajectory(
            **common, status="failed", failure=RolloutFailure(kind=failure, message="slow")
        )
    return Trajectory(
        **common, status="ok", reward=reward, turns=turns or [turn([1], [2], version=3)]
    )
