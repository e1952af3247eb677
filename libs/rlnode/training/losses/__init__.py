"""Policy losses, one module per algorithm, chosen by name in the job config
(`training.algorithm`): grpo (the default), dr_grpo, dapo, gspo. README's "Training methods"
table says what each does; rlnode.training.losses.base what they share."""

from __future__ import annotations

from rlnode.messages import TrainingSpec
from rlnode.messages.config import SamplingSpec
from rlnode.training.losses.base import LossInputs, LossSettings, LossTerms, PolicyLoss
from rlnode.training.losses.dapo import DAPO
from rlnode.training.losses.dr_grpo import DrGRPO
from rlnode.training.losses.grpo import GRPO
from rlnode.training.losses.gspo import GSPO

LOSSES: dict[str, type[PolicyLoss]] = {cls.name: cls for cls in (GRPO, DrGRPO, DAPO, GSPO)}


def loss_class(algorithm: str) -> type[PolicyLoss]:
    try:
        return LOSSES[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown training.algorithm {algorithm!r}: choose one of {', '.join(LOSSES)}"
        ) from None


def loss_settings(training: TrainingSpec, sampling: SamplingSpec | None = None) -> LossSettings:
    """The job's loss knobs, the algorithm's defaults where the job sets none."""
    sampling = sampling or SamplingSpec()
    low, high = loss_class(training.algorithm).default_clip
    clip_low = training.clip_eps if training.clip_eps is not None else low
    if training.clip_eps_high is not None:
        clip_high = training.clip_eps_high
    elif training.clip_eps is not None and high == low:
        clip_high = clip_low  # one ε given for a symmetric algorithm: both sides
    else:
        clip_high = high
    return LossSettings(
        clip_low=clip_low,
        clip_high=clip_high,
        kl_coef=training.kl_coef,
        kl_estimator=training.kl_estimator,
        kl_penalty=training.kl_penalty,
        tis_cap=training.tis_cap,
        max_tokens=sampling.max_tokens,
    )


def make_loss(settings: LossSettings, algorithm: str) -> PolicyLoss:
    return loss_class(algorithm)(settings)


__all__ = [
    "LOSSES",
    "LossInputs",
    "LossSettings",
    "LossTerms",
    "PolicyLoss",
    "loss_class",
    "loss_settings",
    "make_loss",
]
