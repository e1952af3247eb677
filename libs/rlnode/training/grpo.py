"""Group-relative advantages and the clipped policy-gradient objective (GRPO family).

A sample is one inference call (turn) of one trajectory: its prompt and completion tokens,
the behaviour policy's logprobs of the completion (recorded by the generator), optionally
the reference model's, and the trajectory's advantage.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from rlnode.messages import Trajectory


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    ref_logprobs: list[float] | None = None
    policy_version: int = 0
    trajectory_id: str = ""

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


# Rewards this close count as equal.
TIED = 1e-12


def group_advantages(
    trajectories: Iterable[Trajectory], scale_by_std: bool = True, eps: float = 1e-6
) -> dict[str, float]:
    """Advantage of each ok trajectory (by id): its reward minus its group's mean, divided by
    the group's standard deviation (population) when `scale_by_std`. A group whose rewards
    are all equal teaches nothing: its advantages are 0."""
    groups: dict[str, list[tuple[Trajectory, float]]] = defaultdict(list)  # with its reward
    for t in trajectories:
        if t.status == "ok" and t.reward is not None:
            groups[t.group_id].append((t, t.reward))
    advantages: dict[str, float] = {}
    for members in groups.values():
        rewards = [reward for _, reward in members]
        if max(rewards) - min(rewards) <= TIED:
            # Tied: exactly 0, not the rounding left by the mean of rewards like 2/3 (which
            # divided by a tiny std made ~1e-10 advantages, and a training step of no use).
            advantages.update((str(t.id), 0.0) for t, _ in members)
            continue
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        for t, reward in members:
            centred = reward - mean
            advantages[str(t.id)] = (
                centred / (std + eps) if scale_by_std and std > 0 else (centred if std > 0 else 0.0)
            )
    return advantages


def samples_from(trajectories: Iterable[Trajectory], advantages: dict[str, float]) -> list[Sample]:
    """One sample per turn; every turn of a trajectory shares its advantage."""
    samples = []
    for t in trajectories:
        advantage = advantages.get(str(t.id))
        if advantage is None:
            continue
        for turn in t.turns:
            if turn.completion_ids:
                samples.append(
                    Sample(
                        prompt_ids=turn.prompt_ids,
                        completion_ids=turn.completion_ids,
                        behaviour_logprobs=turn.logprobs,
                        advantage=advantage,
                        ref_logprobs=turn.ref_logprobs,
                        policy_version=turn.policy_version,
                        trajectory_id=str(t.id),
                    )
                )
    return samples


def clipped_objective(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO-clip loss with the importance ratio π/μ (which covers both off-policy
    staleness and engine/trainer numerical mismatch), plus `kl_coef` x the k3 estimator of
    KL(π‖π_ref). Returns the *sum* over masked tokens (the caller divides by the token
    count of the whole batch, so micro-batching and data parallelism do not change it) and
    sums of the metrics."""
    log_ratio = (logprobs - behaviour_logprobs) * mask
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    metrics = {
        "clipped_tokens": (((ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps)).float() * mask)
        .sum()
        .detach(),
        "ratio_sum": (ratio * mask).sum().detach(),
    }
    if ref_logprobs is not None:
        # k3 = exp(ref - π) - (ref - π) - 1 ≥ 0, an unbiased low-variance KL estimator.
        delta = (ref_logprobs - logprobs) * mask
        k3 = torch.exp(delta) - delta - 1.0
        metrics["kl_sum"] = (k3 * mask).sum().detach()
        if kl_coef > 0:
            per_token = per_token + kl_coef * k3
    return (per_token * mask).sum(), metrics
