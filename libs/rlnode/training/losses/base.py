"""What every policy loss shares: the batch it is given, what it returns, the importance
ratio (with truncated importance sampling), the KL term and the aggregation over tokens.

A loss returns *sums* over its micro-batch (`LossTerms.total`) and says what the optimizer
step's sum is divided by (`normaliser`, over the whole step): micro-batching and data
parallelism then do not change the loss. Each algorithm is a small module beside this one
(rlnode.training.losses.grpo, dr_grpo, dapo, gspo), chosen by `training.algorithm`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from rlnode.training.grpo import Sample, trained_tokens
from rlnode.training.losses.kl import kl_estimate

KlEstimator = Literal["k1", "k2", "k3"]
KlPenalty = Literal["loss", "reward"]


@dataclass(frozen=True)
class LossSettings:
    """The knobs of a loss, resolved from the job's `[training]` (algorithm defaults applied)."""

    clip_low: float
    clip_high: float
    kl_coef: float = 0.0
    kl_estimator: KlEstimator = "k3"
    kl_penalty: KlPenalty = "loss"
    tis_cap: float | None = None  # truncated importance sampling of the trainer/sampler ratio
    max_tokens: int = 64  # sampling.max_tokens: Dr. GRPO's constant normaliser


@dataclass
class LossInputs:
    """One micro-batch, [rows, width] right-padded (advantages [rows, 1])."""

    logprobs: torch.Tensor  # the trainer's, with gradients
    behaviour: torch.Tensor  # the sampler's (recorded by the generator)
    advantages: torch.Tensor
    mask: torch.Tensor  # 1.0 at trained tokens
    reference: torch.Tensor | None = None
    # The trainer's logprobs before this training step's first update (truncated IS): None
    # means `logprobs.detach()`, exact when the step takes one optimizer step.
    proximal: torch.Tensor | None = None


@dataclass
class LossTerms:
    total: torch.Tensor  # sum over the micro-batch, divided by the step's normaliser later
    clipped_tokens: torch.Tensor
    ratio_sum: torch.Tensor
    kl_sum: torch.Tensor | None = None  # of the chosen estimator, over masked tokens
    mismatch_kl_sum: torch.Tensor | None = None  # k3 of sampler vs trainer, masked tokens


class PolicyLoss(ABC):
    """A policy-gradient loss of the GRPO family. Subclasses say how advantages are scaled,
    how a token's (or a sequence's) policy term is computed and how terms are aggregated."""

    name: ClassVar[str]
    # Group advantages divided by the group's standard deviation (Dr. GRPO says not to).
    scale_by_std: ClassVar[bool] = True
    # Default clip range (low, high) when the job sets none.
    default_clip: ClassVar[tuple[float, float]] = (0.2, 0.2)

    def __init__(self, settings: LossSettings) -> None:
        self.settings = settings

    # -- what the trainer calls -----------------------------------------------------------

    def normaliser(self, samples: Sequence[Sample]) -> float:
        """What the optimizer step's summed loss is divided by, given all of its samples (all
        ranks' together). Token mean by default: the tokens trained."""
        return float(sum(trained_tokens(s) for s in samples)) or 1.0

    def __call__(self, batch: LossInputs) -> LossTerms:
        mask = batch.mask
        advantages = self._token_advantages(batch)
        per_token, clipped, ratio = self.policy_term(batch, advantages)
        terms = LossTerms(
            total=self.aggregate(per_token, mask),
            clipped_tokens=(clipped.float() * mask).sum().detach(),
            ratio_sum=(ratio.detach() * mask).sum(),
            mismatch_kl_sum=(mismatch_k3(batch.logprobs, batch.behaviour) * mask).sum().detach(),
        )
        if batch.reference is not None:
            kl = kl_estimate(batch.logprobs, batch.reference, self.settings.kl_estimator)
            terms.kl_sum = (kl * mask).sum().detach()
            if self.settings.kl_coef > 0 and self.settings.kl_penalty == "loss":
                terms.total = terms.total + self.aggregate(self.settings.kl_coef * kl, mask)
        return terms

    # -- what subclasses define ------------------------------------------------------------

    @abstractmethod
    def policy_term(
        self, batch: LossInputs, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token loss [rows, width], where the ratio was clipped (bool) and the ratio."""

    def aggregate(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The micro-batch's share of the step's sum (token mean: masked tokens summed)."""
        return (per_token * mask).sum()

    # -- shared pieces ----------------------------------------------------------------------

    def _token_advantages(self, batch: LossInputs) -> torch.Tensor:
        """The advantage of each token: the trajectory's, less the KL penalty of the tokens
        from it to the end when the KL is a reward penalty (no discount, no critic: a token's
        return is the reward minus the penalties still to come)."""
        advantages = batch.advantages.expand_as(batch.logprobs)
        s = self.settings
        if batch.reference is None or s.kl_coef <= 0 or s.kl_penalty != "reward":
            return advantages
        penalty = s.kl_coef * kl_estimate(batch.logprobs.detach(), batch.reference, s.kl_estimator)
        penalty = penalty * batch.mask
        to_go = penalty.flip(-1).cumsum(-1).flip(-1)
        return advantages - to_go

    def ratio_and_weight(self, batch: LossInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ratio the objective clips and, with truncated importance sampling, the weight
        that multiplies each token's term.

        Without TIS: π/μ (the trainer's policy over the sampler's), which carries staleness
        and the engines' numerical mismatch at once. With TIS (cap C): π/π_prox clipped as
        PPO does, times min(π_prox/μ, C), detached: the sampler/trainer gap is corrected but
        a token whose engines disagree wildly cannot dominate the step."""
        log_mu = batch.behaviour
        if self.settings.tis_cap is None:
            return torch.exp((batch.logprobs - log_mu) * batch.mask), None
        proximal = batch.proximal if batch.proximal is not None else batch.logprobs.detach()
        ratio = torch.exp((batch.logprobs - proximal) * batch.mask)
        weight = torch.exp((proximal - log_mu) * batch.mask).clamp(max=self.settings.tis_cap)
        return ratio, weight.detach()


def mismatch_k3(logprobs: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(μ‖π) from tokens the sampler μ drew: r - 1 - log r with
    r = π/μ. Zero when the engines agree; the `mismatch_kl` a step reports."""
    log_ratio = (logprobs.detach() - behaviour).clamp(-20.0, 20.0)
    # expm1 and the floor: exp(x) - 1 - x rounds to a tiny negative near x = 0.
    return (torch.expm1(log_ratio) - log_ratio).clamp(min=0.0)


def clipped_token_term(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip per token: -min(r·A, clip(r, 1-ε_low, 1+ε_high)·A) (x the TIS weight) and
    where r left the range."""
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    if weight is not None:
        per_token = per_token * weight
    outside = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
    return per_token, outside
