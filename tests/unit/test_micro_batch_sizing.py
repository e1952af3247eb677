"""Micro-batch budgets sized from measured passes: the climb over powers of two (passes
timed for real, their cost a sleep per token), the memory cap from the bytes a pass saves
for its backward, and the trainer reporting the budget it trained at."""

from __future__ import annotations

import time

import pytest
import torch

from rlnode.messages import TrainingSpec
from rlnode.messages.config import AdamWSpec
from rlnode.models.build import init_tiny_model
from rlnode.training.micro_batch_sizing import FLOOR_TOKENS, MicroBatchSizer
from rlnode.training.trainer import Trainer, TrainerConfig
from tests.unit.test_trainer import _samples


def _climb(
    sizer: MicroBatchSizer, seconds_per_token: dict[int, float], step_tokens: int
) -> list[int]:
    """Steps of `step_tokens` in passes of the budget, each pass sleeping its cost; returns
    the budgets the steps ran at."""
    tried = []
    for _ in range(12):
        if sizer.settled:
            break
        tried.append(sizer.budget)
        passes = max(step_tokens // sizer.budget, 1)
        for _ in range(passes):
            size = min(sizer.budget, step_tokens)
            with sizer.measure(size):
                time.sleep(size * seconds_per_token[sizer.budget])
        sizer.step_done()
    return tried


def test_the_budget_climbs_while_larger_passes_are_faster_and_stays_at_the_fastest() -> None:
    sizer = MicroBatchSizer("cpu")
    cost = {1024: 4e-5, 2048: 2e-5, 4096: 1e-5, 8192: 2e-5}
    assert _climb(sizer, cost, step_tokens=8192) == [1024, 2048, 4096, 8192]
    assert sizer.settled and sizer.budget == 4096


def test_the_budget_goes_down_where_smaller_passes_are_faster() -> None:
    """The CPU's case (SmolLM2's 1024-token passes beat 4096-token ones)."""
    sizer = MicroBatchSizer("cpu")
    cost = {256: 3e-5, 512: 1e-5, 1024: 2e-5, 2048: 3e-5}
    assert _climb(sizer, cost, step_tokens=4096) == [1024, 2048, 512, 256]
    assert sizer.budget == 512


def test_a_budget_must_be_clearly_faster_to_take_the_place_of_the_first() -> None:
    sizer = MicroBatchSizer("cpu")
    same = dict.fromkeys((512, 1024, 2048), 5e-5)
    assert _climb(sizer, same, step_tokens=4096) == [1024, 2048, 512]
    assert sizer.budget == 1024


def test_steps_smaller_than_half_the_budget_do_not_climb() -> None:
    sizer = MicroBatchSizer("cpu")
    cost = dict.fromkeys((256, 512, 1024), 2e-5)
    assert 2048 not in _climb(sizer, cost, step_tokens=300)


def test_a_fixed_budget_never_moves_and_measures_nothing() -> None:
    sizer = MicroBatchSizer("cpu", fixed=3000)
    with sizer.measure(3000):
        torch.ones(4, requires_grad=True).exp().sum().backward()
    assert sizer.step_done() == 3000 and sizer.settled and sizer.bytes_per_token == 0.0


def test_memory_saved_for_backward_is_counted_per_token_and_caps_the_budget() -> None:
    layer = torch.nn.Linear(256, 256)
    sizer = MicroBatchSizer("cpu", memory_share=1e-9)
    sizer.exclude(layer.parameters())
    tokens = 512
    with sizer.measure(tokens):
        hidden = torch.randn(tokens, 256)
        layer(hidden).tanh().sum().backward()
    # tanh saves its output (tokens x 256 floats); the linear saves its input; the weight
    # (a parameter) is not counted
    assert sizer.bytes_per_token == pytest.approx(2 * 256 * 4, rel=0.01)
    assert sizer.step_done() == FLOOR_TOKENS and sizer.settled  # no memory to spare


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def test_the_trainer_settles_on_a_measured_budget_and_reports_it(model_dir) -> None:
    trainer = Trainer(model_dir, TrainerConfig.of(TrainingSpec(optimizer=AdamWSpec(lr=1e-3))))
    assert trainer.config.tokens_per_micro_batch is None  # "measured", the default
    samples = _samples(trainer)
    budgets = [trainer.step(samples).micro_batch_tokens for _ in range(4)]
    assert budgets[0] == 1024 and trainer.micro_batches.settled
    assert trainer.micro_batches.bytes_per_token > 0
