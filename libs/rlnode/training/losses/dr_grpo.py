"""Dr. GRPO ("Understanding R1-Zero-Like Training", Liu et al. 2025): GRPO without its two
biases. Advantages are not divided by the group's standard deviation (which weighs
too-easy and too-hard questions up), and the summed token terms are divided by a constant
(samples x sampling.max_tokens) instead of by the tokens generated, so a long wrong answer
is not penalised less per token than a short one. A multi-turn episode trained as one
sequence counts once per turn (its inference calls), as it would per turn."""

from __future__ import annotations

from collections.abc import Sequence

from rlnode.training.grpo import Sample, model_turns
from rlnode.training.losses.grpo import GRPO


class DrGRPO(GRPO):
    name = "dr_grpo"
    scale_by_std = False

    def normaliser(self, samples: Sequence[Sample]) -> float:
        return float(sum(model_turns(s) for s in samples) * self.settings.max_tokens) or 1.0
