"""Evaluation rounds without a node: which steps a job evaluates, what a config may not ask
(seeds training visits, no steps and no [eval]), what a round adds up to (pass@1, pass@k),
the work it issues and what the Task App is told."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlnode.messages import JobConfig, Trajectory
from rlnode.messages.config import EvalSpec
from rlnode.taskapp.bridge import rollout_request
from rlnode.training.evaluation import EvalRound, eval_message, eval_work, summarise
from tests import factories


def job(
    steps: int = 10, evaluation: dict | None = None, logging: dict | None = None, **seeds
) -> JobConfig:
    data: dict = {
        "model": {"source": "org/model"},
        "task_app": {"name": "app"},
        "training": {"steps": steps, "prompts_per_step": 4},
        "seeds": seeds or {"start": 0},
    }
    if evaluation is not None:
        data["eval"] = evaluation
    if logging is not None:
        data["logging"] = logging
    return JobConfig.model_validate(data)


def test_rounds_run_every_n_steps_after_the_last_and_optionally_at_start() -> None:
    held_out = {"start": 10_000, "count": 4}
    assert job(10, {"every": 4, "seeds": held_out}).eval_steps() == [4, 8, 10]
    assert job(8, {"every": 4, "seeds": held_out, "at_start": True}).eval_steps() == [0, 4, 8]
    assert job(10, {"seeds": held_out}).eval_steps() == []  # every = 0: off
    assert job(0, {"seeds": held_out}).eval_steps() == [0]  # an evaluation-only job
    assert job(10).eval_steps() == []


def test_a_config_may_not_evaluate_on_seeds_it_trains_on() -> None:
    # 10 steps x 4 prompts visit seeds 0..39: 30..35 are not held out.
    with pytest.raises(ValidationError, match=r"eval.seeds 30..35 overlap .* \(0..39\)"):
        job(10, {"every": 5, "seeds": {"start": 30, "count": 6}})
    # Bounded training seeds wrap around: only those are visited.
    assert job(10, {"every": 5, "seeds": {"start": 30, "count": 6}}, start=0, count=30)
    with pytest.raises(ValidationError, match=r"training\.steps = 0 trains nothing"):
        job(0)


def trajectory(seed: int, reward: float | None, sample: int = 0) -> Trajectory:
    return factories.trajectory(
        seed=seed, sample=sample, reward=reward, step=4, group_id=f"eval/4/{seed}", mode="eval"
    )


def test_a_round_adds_up_to_mean_reward_pass_at_1_and_pass_at_k() -> None:
    spec = EvalSpec(seeds={"start": 0, "count": 3}, samples=2, pass_threshold=1.0)
    results = [
        trajectory(0, 1.0, 0),
        trajectory(0, 1.0, 1),  # seed 0: both pass
        trajectory(1, 0.5, 0),
        trajectory(1, 1.0, 1),  # seed 1: one of two
        trajectory(2, 0.0, 0),
        trajectory(2, None, 1),  # seed 2: none, and a failure
    ]
    round_ = EvalRound(step=4, version=3, expected=6)
    round_.results = {t.work_id: t for t in results}
    data = summarise(round_, spec)
    assert (data.count, data.failed, data.k) == (5, 1, 2)
    assert data.reward_mean == pytest.approx(3.5 / 5)
    assert data.pass_at_1 == pytest.approx((2 / 2 + 1 / 2 + 0 / 2) / 3)
    assert data.pass_at_k == pytest.approx(2 / 3)
    assert [(s.seed, s.passed, s.failed) for s in data.per_seed] == [
        (0, 2, 0),
        (1, 1, 0),
        (2, 0, 1),
    ]
    assert eval_message(data).startswith("eval at step 4: reward 0.700, pass@1 0.500, pass@2 0.667")
    single = summarise(round_, spec.model_copy(update={"samples": 1}))
    assert single.pass_at_k is None  # one sample per seed: pass@k is pass@1


def test_a_rounds_work_is_the_held_out_seeds_in_eval_mode() -> None:
    config = job(
        10,
        {"every": 5, "seeds": {"start": 500, "count": 2}, "samples": 3, "temperature": 0.0},
    )
    work = eval_work("j", "o", config, step=5, version=7, samples_per_work=2)
    assert [(w.seed, w.sample_index, w.samples) for w in work] == [
        (s, first, count) for s in (500, 501) for first, count in ((0, 2), (2, 1))
    ]
    assert {(w.mode, w.step, w.policy_version, w.sampling.temperature) for w in work} == {
        ("eval", 5, 7, 0.0)
    }
    again = eval_work("j", "o", config, step=5, version=9, samples_per_work=2)
    assert [w.id for w in work] == [w.id for w in again]  # the same work again
    assert rollout_request(work[0], "r", "http://x").mode == "eval"
    train = work[0].model_copy(update={"mode": "train"})
    assert rollout_request(train, "r", "http://x").mode == "rl"


def test_logging_names_only_trackers_that_write_on_this_machine() -> None:
    chosen = job(10, logging={"tensorboard": True, "wandb": {"project": "p"}})
    assert chosen.logging is not None and chosen.logging.trackers == ["tensorboard", "wandb"]
    with pytest.raises(ValidationError, match="sends no metrics off the machine"):
        job(10, logging={"wandb": {"mode": "online"}})
