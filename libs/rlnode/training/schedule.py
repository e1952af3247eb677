"""The learning rate of each training step, from the job's `[training.optimizer.schedule]`:
a linear warmup, then constant or a linear or cosine decay (the shapes TRL's
`lr_scheduler_type` and prime-rl's schedulers offer)."""

from __future__ import annotations

import math

from rlnode.messages.config import AdamWSpec


def learning_rate_at(optimizer: AdamWSpec, step: int, total_steps: int) -> float:
    """The rate of training step `step` (counted from 0) of a job of `total_steps` steps.

    The warmup's step k takes (k+1)/(warmup+1) of the peak, so no step is spent at rate 0
    (Hugging Face's warmup starts at 0). A decay runs from the end of the warmup to
    `decay_steps` (default: the job's steps), then stays at its floor."""
    if step < 0:
        raise ValueError(f"a training step is counted from 0, not {step}")
    schedule, peak = optimizer.schedule, optimizer.lr
    warmup = schedule.warmup_steps
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    if schedule.decay == "constant":
        return peak
    end = schedule.decay_steps or total_steps
    # As Hugging Face's: the floor is reached at step `end`, so a job's last step (end - 1)
    # still learns when the floor is 0.
    progress = min(1.0, (step - warmup) / max(1, end - warmup))
    floor = schedule.min_lr_ratio
    if schedule.decay == "linear":
        share = 1.0 - progress
    else:
        share = 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * (floor + (1.0 - floor) * share)
