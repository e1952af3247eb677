"""Group-relative advantages and the samples a training step is made of (the losses that
turn them into gradients are in rlnode.training.losses).

A sample is one row of training: a prompt and the completion tokens after it, the behaviour
policy's logprobs of the completion (recorded by the generator), optionally the reference
model's, and the trajectory's advantage. A multi-turn trajectory whose turns extend each
other is one sample (`merge_turns`); otherwise each inference call (turn) is one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise

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
    # Which completion tokens are trained: None, all of them; else True exactly at the
    # tokens the model sampled, False at the environment's (between the turns of a merge).
    loss_mask: list[bool] | None = None

    @property
    def tokens(self) -> int:
        """The row's length: prompt and completion tokens."""
        return len(self.prompt_ids) + len(self.completion_ids)


def model_turns(sample: Sample) -> int:
    """How many inference calls the sample's trained tokens came from: 1, or each run of
    model tokens in a merged multi-turn sample."""
    if sample.loss_mask is None:
        return 1
    runs = sum(
        1 for i, m in enumerate(sample.loss_mask) if m and (i == 0 or not sample.loss_mask[i - 1])
    )
    return max(1, runs)


def trained_tokens(sample: Sample) -> int:
    """How many of the sample's completion tokens the loss is taken over."""
    if sample.loss_mask is None:
        return len(sample.completion_ids)
    return sum(sample.loss_mask)


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


@dataclass
class SampleBatch:
    """A step's samples, and how its multi-turn trajectories were made into them."""

    samples: list[Sample]
    merged_trajectories: int = 0  # multi-turn, trained as one sequence
    per_turn_trajectories: int = 0  # multi-turn, whose turns did not extend each other


def sample_batch(
    trajectories: Iterable[Trajectory], advantages: dict[str, float], merge: bool = True
) -> SampleBatch:
    """The samples of the trajectories that have an advantage, each trajectory's sharing it:
    one per trajectory whose turns extend each other (`merge_turns`; with `merge`), else one
    per turn that sampled tokens."""
    batch = SampleBatch([])
    for t in trajectories:
        advantage = advantages.get(str(t.id))
        if advantage is None:
            continue
        merged = merge_turns(t, advantage) if merge else None
        if merged is not None:
            batch.samples.extend(merged)
            batch.merged_trajectories += len(t.turns) > 1
            continue
        batch.per_turn_trajectories += len(t.turns) > 1
        batch.samples.extend(
            Sample(
                prompt_ids=turn.prompt_ids,
                completion_ids=turn.completion_ids,
                behaviour_logprobs=turn.logprobs,
                advantage=advantage,
                ref_logprobs=turn.ref_logprobs,
                policy_version=turn.policy_version,
                trajectory_id=str(t.id),
            )
            for turn in t.turns
            if turn.completion_ids
        )
    return batch


def samples_from(trajectories: Iterable[Trajectory], advantages: dict[str, float]) -> list[Sample]:
    """`sample_batch`'s samples."""
    return sample_batch(trajectories, advantages).samples


def merge_turns(trajectory: Trajectory, advantage: float) -> list[Sample] | None:
    """The trajectory as one sample when every turn's prompt starts, token for token, with
    the previous turn's prompt and completion (the Task App sent the history back as it was
    sampled): the first turn's prompt, then everything after it, with `loss_mask` False at
    the environment's tokens between the turns. Each turn's prompt holds the whole history,
    so a sample per turn trains on that history once per turn (quadratic in the turns); one
    sample trains on it once. None when a turn does not extend the one before (the history
    was truncated, rewritten or re-tokenised differently): then each turn is its own sample.
    The sample's policy version is its oldest turn's; its reference logprobs are there only
    if every turn carried them. No sample ([]) when no turn sampled a token."""
    turns = trajectory.turns
    if not turns:
        return None
    for earlier, later in pairwise(turns):
        so_far = len(earlier.prompt_ids) + len(earlier.completion_ids)
        if later.prompt_ids[:so_far] != earlier.prompt_ids + earlier.completion_ids:
            return None
    if not any(turn.completion_ids for turn in turns):
        return []
    start = len(turns[0].prompt_ids)
    completion: list[int] = []
    mask: list[bool] = []
    behaviour: list[float] = []
    carried = all(turn.ref_logprobs is not None for turn in turns)
    reference: list[float] = []
    for turn in turns:
        environment = turn.prompt_ids[start + len(completion) :]  # since the last completion
        completion += environment + turn.completion_ids
        mask += [False] * len(environment) + [True] * len(turn.completion_ids)
        behaviour += [0.0] * len(environment) + turn.logprobs
        if carried:
            reference += [0.0] * len(environment) + (turn.ref_logprobs or [])
    return [
        Sample(
            prompt_ids=turns[0].prompt_ids,
            completion_ids=completion,
            behaviour_logprobs=behaviour,
            advantage=advantage,
            ref_logprobs=reference if carried else None,
            policy_version=min(turn.policy_version for turn in turns),
            trajectory_id=str(trajectory.id),
            loss_mask=None if all(mask) else mask,
        )
    ]
