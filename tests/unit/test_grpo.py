"""Advantages and samples, on numbers small enough to check by hand (the losses: test_losses)."""

from __future__ import annotations

import math
import uuid

import pytest

from rlnode.messages import RolloutFailure, TokenTurn, Trajectory
from rlnode.training.grpo import group_advantages, samples_from


def _trajectory(group: str, reward: float | None, turns: int = 1, status: str = "ok") -> Trajectory:
    turn = TokenTurn(
        prompt_ids=[1, 2],
        completion_ids=[3, 4],
        logprobs=[-1.0, -2.0],
        policy_version=0,
        finish_reason="stop",
    )
    return Trajectory(
        job_id="j",
        org_id="o",
        work_id=uuid.uuid4(),
        rollout_id="r",
        generator="g",
        step=0,
        group_id=group,
        seed=0,
        sample_index=0,
        status=status,
        turns=[turn] * turns if status == "ok" else [],
        reward=reward,
        failure=None if status == "ok" else RolloutFailure(kind="timeout", message="x"),
    )


def test_group_relative_advantages() -> None:
    a = [_trajectory("g1", r) for r in (1.0, 0.0, 0.5, 0.5)]
    same = [_trajectory("g2", 0.3) for _ in range(3)]
    failed = _trajectory("g1", None, status="failed")
    advantages = group_advantages([*a, *same, failed])
    std = math.sqrt(((0.5) ** 2 + (0.5) ** 2) / 4)
    assert advantages[str(a[0].id)] == pytest.approx(0.5 / std, rel=1e-4)
    assert advantages[str(a[1].id)] == pytest.approx(-0.5 / std, rel=1e-4)
    assert advantages[str(a[2].id)] == pytest.approx(0.0)
    assert all(advantages[str(t.id)] == 0.0 for t in same)  # nothing to learn from a tie
    assert str(failed.id) not in advantages
    unscaled = group_advantages(a, scale_by_std=False)
    assert unscaled[str(a[0].id)] == pytest.approx(0.5)


def test_a_tie_of_rewards_that_do_not_add_up_exactly_is_still_a_tie() -> None:
    """16 x 2/3: their mean is 1 ulp off 2/3, which divided by the tiny std it leaves made
    advantages of ~1e-10 and a training step on nothing (the control-plane benchmark's
    learner trained every step)."""
    rewards = [2 / 3] * 16
    assert sum(rewards) / 16 != 2 / 3  # the rounding the tie must not turn into a signal
    tied = [_trajectory("g", r) for r in rewards]
    assert set(group_advantages(tied).values()) == {0.0}
    assert not [s for s in samples_from(tied, group_advantages(tied)) if s.advantage != 0.0]


def test_every_turn_is_a_sample_with_the_trajectorys_advantage() -> None:
    t = _trajectory("g", 1.0, turns=3)
    samples = samples_from([t], {str(t.id): 0.7})
    assert len(samples) == 3 and {s.advantage for s in samples} == {0.7}
