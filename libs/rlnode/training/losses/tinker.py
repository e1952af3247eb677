"""The Tinker API's losses, per token, as its documentation defines them
(tinker-docs.thinkingmachines.ai/tinker/losses): every datum carries its own inputs, one value
per position, and the loss is a plain sum over tokens and datums, never normalised. A
client's custom loss depends on that: the SDK runs it as a forward pass, differentiates it
itself, and sends the gradient back as the signed `weights` of a cross_entropy pass.

    cross_entropy        -(weights * logp)
    importance_sampling  -(exp(logp - q) * A)
    ppo                  -min(r * A, clip(r, low, high) * A)     r = exp(logp - q); 0.8, 1.2
    cispo                -(sg(clip(r, low, high)) * logp * A)                        0.0, 4.0
    dro                  -(logp * A - beta / 2 * (logp - q)^2)    beta from loss_fn_config

`logp` is the trained model's logprob of `target_tokens`, `q` the sampler's (`logprobs`),
`A` the `advantages`. Clip thresholds come from the datum (`clip_low_threshold`,
`clip_high_threshold`, per token), else from `loss_fn_config`, else the defaults above."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

# The inputs each loss reads beside target_tokens.
INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
}
CLIP_DEFAULTS = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}
CONFIG_KEYS = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
    "dro": ("beta",),
}
THRESHOLDS = ("clip_low_threshold", "clip_high_threshold")


class LossRefused(ValueError):
    """A loss or its inputs this trainer does not take; the message says which and why."""


@dataclass(frozen=True)
class TokenLoss:
    """One of the losses above, with its configuration checked."""

    name: str
    config: Mapping[str, float]

    @classmethod
    def of(cls, name: str, config: Mapping[str, float | str] | None = None) -> TokenLoss:
        if name not in INPUTS:
            raise LossRefused(
                f"loss_fn {name!r} is not supported here: choose one of {', '.join(INPUTS)} "
                "(forward_backward_custom runs on top of cross_entropy)"
            )
        given = dict(config or {})
        unknown = sorted(set(given) - set(CONFIG_KEYS[name]))
        if unknown:
            takes = ", ".join(CONFIG_KEYS[name]) or "no keys"
            raise LossRefused(
                f"loss_fn_config for {name} has {', '.join(map(repr, unknown))}; it takes {takes}"
            )
        numbers: dict[str, float] = {}
        for key, value in given.items():
            try:
                numbers[key] = float(value)
            except (TypeError, ValueError):
                raise LossRefused(
                    f"loss_fn_config[{key!r}] must be a number, got {value!r}"
                ) from None
        if name == "dro" and "beta" not in numbers:
            raise LossRefused(
                "dro needs loss_fn_config={'beta': ...}, the weight of its quadratic penalty"
            )
        return cls(name, numbers)

    def check_inputs(self, present: set[str], datum: int) -> None:
        """Refuse a datum that lacks what this loss reads (`present`: its loss_fn_inputs)."""
        missing = [k for k in ("target_tokens", *INPUTS[self.name]) if k not in present]
        if missing:
            raise LossRefused(
                f"datum {datum} has no {', '.join(missing)} in loss_fn_inputs, which "
                f"{self.name} needs (it reads {', '.join(('target_tokens', *INPUTS[self.name]))})"
            )

    def differentiated(self, inputs: Mapping[str, Sequence[float]], tokens: int) -> list[bool]:
        """Which of a datum's positions this loss has a gradient at: the others' logprobs
        are computed without one (the client still gets them), which spares their share of
        the backward pass. A position weighted 0 (cross_entropy) or with advantage 0 has
        none, except under dro, whose penalty on the log-ratio has one everywhere."""
        if self.name == "dro":
            return [True] * tokens
        scale = inputs["weights" if self.name == "cross_entropy" else "advantages"]
        return [value != 0.0 for value in scale]

    def per_token(self, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The loss of each token (same shape as `logprobs`; padding gets 0 from the caller's
        inputs being 0 there, and is masked by the caller)."""
        if self.name == "cross_entropy":
            return -(inputs["weights"] * logprobs)
        sampled, advantages = inputs["logprobs"], inputs["advantages"]
        log_ratio = logprobs - sampled
        if self.name == "importance_sampling":
            return -(torch.exp(log_ratio) * advantages)
        if self.name == "dro":
            beta = self.config["beta"]
            return -(logprobs * advantages - 0.5 * beta * log_ratio**2)
        ratio = torch.exp(log_ratio)
        low, high = self._thresholds(inputs, ratio)
        clipped = torch.minimum(torch.maximum(ratio, low), high)
        if self.name == "ppo":
            return -torch.minimum(ratio * advantages, clipped * advantages)
        return -(clipped.detach() * logprobs * advantages)  # cispo

    def _thresholds(
        self, inputs: Mapping[str, torch.Tensor], like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        defaults = dict(zip(THRESHOLDS, CLIP_DEFAULTS[self.name], strict=True))
        out = []
        for key in THRESHOLDS:
            if key in inputs:
                out.append(inputs[key])
            else:
                out.append(torch.full_like(like, self.config.get(key, defaults[key])))
        return out[0], out[1]
