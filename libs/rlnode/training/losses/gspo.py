"""GSPO ("Group Sequence Policy Optimization", Zheng et al. 2025): the importance ratio of a
whole sequence, s = exp(mean over its tokens of log π/μ), clipped as one (with the paper's
tiny range, 3e-4 / 4e-4, since a length-normalised ratio stays near 1), and a sequence mean:
every sequence's term weighs the same. Token-level noise in the ratio (MoE routing, the
engines' numerical mismatch) averages out instead of clipping single tokens. A multi-turn
episode trained as one sequence has one ratio over its model tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlnode.training.grpo import Sample
from rlnode.training.losses.base import LossInputs, PolicyLoss, clipped_token_term


class GSPO(PolicyLoss):
    name = "gspo"
    default_clip = (3e-4, 4e-4)

    def policy_term(
        self, batch: LossInputs, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ratio, weight = self.ratio_and_weight(batch)
        mask = batch.mask
        lengths = mask.sum(-1, keepdim=True).clamp(min=1.0)
        sequence_log_ratio = (torch.log(ratio) * mask).sum(-1, keepdim=True) / lengths
        sequence_ratio = torch.exp(sequence_log_ratio).expand_as(batch.logprobs)
        # A sequence's advantage: its tokens' mean (they are equal unless the KL is a reward
        # penalty, which makes later tokens' smaller).
        sequence_advantage = ((advantages * mask).sum(-1, keepdim=True) / lengths).expand_as(
            batch.logprobs
        )
        if weight is not None:  # TIS: one weight per sequence, the mean of its tokens'
            weight = ((weight * mask).sum(-1, keepdim=True) / lengths).expand_as(batch.logprobs)
        s = self.settings
        per_token, outside = clipped_token_term(
            sequence_ratio, sequence_advantage, s.clip_low, s.clip_high, weight
        )
        return per_token, outside, sequence_ratio

    def aggregate(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each sequence's mean over its tokens, summed over sequences."""
        lengths = mask.sum(-1).clamp(min=1.0)
        return ((per_token * mask).sum(-1) / lengths).sum()

    def normaliser(self, samples: Sequence[Sample]) -> float:
        return float(len(samples)) or 1.0
