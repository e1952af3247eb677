"""GRPO as rlnode has always trained it: group-relative advantages scaled by the group's
standard deviation, PPO-clip with one ε, and the token mean over the whole step (every token
weighs the same, as DAPO argued and prime-rl does, instead of GRPO's per-sequence mean that
gives a short answer's tokens more weight than a long one's)."""

from __future__ import annotations

import torch

from rlnode.training.losses.base import LossInputs, PolicyLoss, clipped_token_term


class GRPO(PolicyLoss):
    name = "grpo"

    def policy_term(
        self, batch: LossInputs, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ratio, weight = self.ratio_and_weight(batch)
        s = self.settings
        per_token, outside = clipped_token_term(ratio, advantages, s.clip_low, s.clip_high, weight)
        return per_token, outside, ratio
