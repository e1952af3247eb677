"""Estimators of KL(π‖π_ref) from tokens sampled by the policy (Schulman, "Approximating KL
divergence"), each per token: with log r = log π_ref - log π,
  k1 = -log r               unbiased, high variance, can be negative;
  k2 = (log r)² / 2         biased, low variance, its gradient is that of the true KL's;
  k3 = r - 1 - log r        unbiased, low variance, never negative (the default).
"""

from __future__ import annotations

from typing import Literal

import torch


def kl_estimate(
    logprobs: torch.Tensor, reference: torch.Tensor, estimator: Literal["k1", "k2", "k3"]
) -> torch.Tensor:
    log_r = reference - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}: choose k1, k2 or k3")
