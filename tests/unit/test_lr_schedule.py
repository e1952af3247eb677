"""Learning-rate schedules and the typed optimizer settings of a job config."""

from __future__ import annotations

import itertools
import math
import re

import pytest
from pydantic import ValidationError

from rlnode.messages import TrainingSpec
from rlnode.messages.config import AdamWSpec, LrScheduleSpec
from rlnode.training.schedule import learning_rate_at


def rates(schedule: dict, steps: int, lr: float = 1.0) -> list[float]:
    optimizer = AdamWSpec(lr=lr, schedule=LrScheduleSpec.model_validate(schedule))
    return [learning_rate_at(optimizer, step, steps) for step in range(steps)]


def test_constant_is_the_default_and_holds_the_peak() -> None:
    assert rates({}, 4, lr=3e-3) == [3e-3] * 4


def test_warmup_rises_linearly_and_its_first_step_already_learns() -> None:
    assert rates({"warmup_steps": 3}, 5) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_linear_decay_reaches_its_floor_at_decay_steps_and_the_last_step_still_learns() -> None:
    assert rates({"decay": "linear"}, 4) == pytest.approx([1.0, 0.75, 0.5, 0.25])
    floored = rates({"decay": "linear", "min_lr_ratio": 0.2, "decay_steps": 3}, 5)
    assert floored == pytest.approx([1.0, 1 - 0.8 / 3, 1 - 1.6 / 3, 0.2, 0.2])


def test_cosine_decay_after_a_warmup() -> None:
    got = rates({"warmup_steps": 1, "decay": "cosine", "min_lr_ratio": 0.1}, 6)
    # Step 1 starts the decay at the peak; it falls as half a cosine over 5 steps to 0.1.
    assert got[0] == pytest.approx(0.5) and got[1] == pytest.approx(1.0)
    assert got[3] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 2 / 5)))
    assert all(a > b for a, b in itertools.pairwise(got[1:])) and got[-1] > 0.1


def test_the_flat_keys_of_older_jobs_are_the_optimizers() -> None:
    spec = TrainingSpec.model_validate(
        {"learning_rate": 3e-3, "weight_decay": 0.1, "max_grad_norm": 0.5}
    )
    assert (spec.optimizer.lr, spec.optimizer.weight_decay, spec.optimizer.max_grad_norm) == (
        3e-3,
        0.1,
        0.5,
    )
    assert spec.optimizer.betas == (0.9, 0.999) and spec.optimizer.eps == 1e-8


@pytest.mark.parametrize(
    ("training", "says"),
    [
        (
            {"learning_rate": 1e-3, "optimizer": {"lr": 1e-4}},
            "training.learning_rate and training.optimizer.lr are the same setting",
        ),
        (
            {"steps": 10, "optimizer": {"schedule": {"warmup_steps": 10}}},
            "warmup_steps (10) is not below training.steps (10)",
        ),
        (
            {"optimizer": {"schedule": {"warmup_steps": 5, "decay_steps": 5}}},
            "decay_steps (5) must be above warmup_steps (5)",
        ),
        ({"optimizer": {"name": "sgd"}}, "'adamw'"),
        ({"optimizer": {"betas": [0.9, 1.0]}}, "less than 1"),
        ({"optimizer": {"schedule": {"decay": "step"}}}, "'constant', 'linear' or 'cosine'"),
    ],
)
def test_bad_optimizer_settings_say_what_is_wrong(training: dict, says: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(says)):
        TrainingSpec.model_validate(training)
