"""Each policy loss (rlnode.training.losses) on numbers worked out by hand: the terms, their
gradients, what is clipped, the normaliser, the KL estimators (as a loss and as a reward
penalty), truncated importance sampling, the mismatch metric and DAPO's overlong penalty;
then every algorithm through a real trainer step on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from rlnode.messages import JobConfig, TrainingSpec
from rlnode.messages.config import AdamWSpec
from rlnode.models.build import init_tiny_model
from rlnode.training.grpo import Sample
from rlnode.training.losses import LOSSES, LossInputs, LossSettings, loss_settings, make_loss
from rlnode.training.losses.base import mismatch_k3
from rlnode.training.losses.dapo import overlong_shaped
from rlnode.training.losses.kl import kl_estimate
from rlnode.training.trainer import Trainer, TrainerConfig


def _loss(algorithm: str, **settings):
    low, high = LOSSES[algorithm].default_clip
    return make_loss(LossSettings(**{"clip_low": low, "clip_high": high, **settings}), algorithm)


def _one_token(log_ratio: float, advantage: float, algorithm: str, **settings):
    """A one-token batch whose trainer/sampler log ratio is `log_ratio`: (loss, grad, terms)."""
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    terms = _loss(algorithm, **settings)(
        LossInputs(
            logprobs=logprobs,
            behaviour=torch.tensor([[-1.0 - log_ratio]]),
            advantages=torch.tensor([[advantage]]),
            mask=torch.ones(1, 1),
        )
    )
    terms.total.backward()
    return float(terms.total.detach()), float(logprobs.grad), terms


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "dapo"])
def test_on_policy_token_terms_are_minus_the_advantage(algorithm: str) -> None:
    logprobs = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    terms = _loss(algorithm)(
        LossInputs(
            logprobs=logprobs,
            behaviour=logprobs.detach(),
            advantages=torch.tensor([[2.0]]),
            mask=torch.tensor([[1.0, 1.0, 0.0]]),
        )
    )
    terms.total.backward()
    assert float(terms.total.detach()) == pytest.approx(-4.0)  # -A per trained token, summed
    assert logprobs.grad.tolist() == [[-2.0, -2.0, 0.0]]  # padding gets nothing
    assert float(terms.clipped_tokens) == 0 and float(terms.ratio_sum) == pytest.approx(2.0)
    assert float(terms.mismatch_kl_sum) == pytest.approx(0.0)


def test_grpo_clips_a_ratio_of_1_25_and_dapo_clip_higher_does_not() -> None:
    log_ratio = math.log(1.25)
    loss, grad, terms = _one_token(log_ratio, 1.0, "grpo")
    assert loss == pytest.approx(-1.2) and grad == 0.0 and float(terms.clipped_tokens) == 1
    loss, grad, terms = _one_token(log_ratio, 1.0, "dapo")  # 1.25 < 1 + 0.28
    assert loss == pytest.approx(-1.25) and grad == pytest.approx(-1.25)  # d(r·A)/d log π = r·A
    assert float(terms.clipped_tokens) == 0
    # Below 1 both clip at 0.8: a negative advantage whose ratio fell to 0.75 stops pushing.
    loss, grad, _ = _one_token(math.log(0.75), -1.0, "dapo")
    assert loss == pytest.approx(0.8) and grad == 0.0


def _sample(tokens: int, loss_mask: list[bool] | None = None) -> Sample:
    return Sample([1], [2] * tokens, [0.0] * tokens, 1.0, loss_mask=loss_mask)


def test_dr_grpo_divides_by_a_constant_and_does_not_scale_by_std() -> None:
    samples = [_sample(3), _sample(5)]
    assert _loss("grpo").normaliser(samples) == 8  # the tokens trained
    assert _loss("dr_grpo", max_tokens=64).normaliser(samples) == 2 * 64  # samples x max_tokens
    assert LOSSES["grpo"].scale_by_std and not LOSSES["dr_grpo"].scale_by_std
    # A multi-turn episode as one sequence (model, environment, model tokens) counts per
    # turn, as its per-turn samples would, and only its model tokens count as trained.
    merged = _sample(6, [True, True, False, False, True, True])
    assert _loss("dr_grpo", max_tokens=64).normaliser([merged]) == 2 * 64
    assert _loss("grpo").normaliser([merged]) == 4


def test_gspo_clips_the_sequence_ratio_and_weighs_sequences_equally() -> None:
    # Token log ratios 0.1 and -0.3: the sequence's is their mean, -0.1.
    logprobs = torch.tensor([[-1.0, -1.0, 0.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.1, -0.7, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    s = math.exp(-0.1)
    gspo = _loss("gspo")
    terms = gspo(LossInputs(logprobs, behaviour, torch.tensor([[1.0]]), mask))
    terms.total.backward()
    # A > 0 and s < 1: min(s·A, clip(s)·A) is s·A, unclipped; the sequence's mean term is -s.
    assert float(terms.total.detach()) == pytest.approx(-s, rel=1e-6)
    assert logprobs.grad.tolist()[0][:2] == pytest.approx([-s / 2, -s / 2], rel=1e-6)
    assert float(terms.clipped_tokens) == 2  # the sequence left [1 - 3e-4, 1 + 4e-4]
    assert gspo.normaliser([_sample(2), _sample(7)]) == 2  # a mean over sequences
    logprobs.grad = None
    terms = gspo(LossInputs(logprobs, behaviour, torch.tensor([[-1.0]]), mask))
    terms.total.backward()  # A < 0: the clipped term (1 - 3e-4)·A is the smaller loss... and flat
    assert float(terms.total.detach()) == pytest.approx(1 - 3e-4, rel=1e-6)
    assert logprobs.grad.abs().sum() == 0.0


def test_the_kl_estimators_by_hand() -> None:
    logprobs, reference = torch.tensor([-1.0]), torch.tensor([-1.5])  # log r = -0.5
    assert float(kl_estimate(logprobs, reference, "k1")) == pytest.approx(0.5)
    assert float(kl_estimate(logprobs, reference, "k2")) == pytest.approx(0.125)
    assert float(kl_estimate(logprobs, reference, "k3")) == pytest.approx(math.exp(-0.5) - 0.5)
    for estimator in ("k1", "k2", "k3"):
        assert float(kl_estimate(logprobs, logprobs, estimator)) == 0.0  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="choose k1, k2 or k3"):
        kl_estimate(logprobs, reference, "k4")  # type: ignore[arg-type]


def test_kl_as_a_loss_term_adds_coef_times_the_estimate() -> None:
    logprobs = torch.tensor([[-1.0, -1.0]])
    reference = logprobs - 0.5
    terms = _loss("grpo", kl_coef=0.1, kl_estimator="k3")(
        LossInputs(logprobs, logprobs, torch.zeros(1, 1), torch.ones(1, 2), reference)
    )
    k3 = math.exp(-0.5) + 0.5 - 1
    assert float(terms.kl_sum) == pytest.approx(2 * k3, rel=1e-5)
    assert float(terms.total) == pytest.approx(0.1 * 2 * k3, rel=1e-5)


def test_kl_as_a_reward_penalty_lowers_each_tokens_advantage_by_the_penalties_to_come() -> None:
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    reference = torch.tensor([[-1.5, -1.0, -2.0]])  # k1 = [0.5, 0, 1]; x 0.1 = [.05, 0, .1]
    terms = _loss("grpo", kl_coef=0.1, kl_estimator="k1", kl_penalty="reward")(
        LossInputs(logprobs, logprobs.detach(), torch.tensor([[1.0]]), torch.ones(1, 3), reference)
    )
    terms.total.backward()
    # Advantages 1 - [0.15, 0.1, 0.1]; on policy each token's gradient is minus its advantage.
    assert logprobs.grad.tolist()[0] == pytest.approx([-0.85, -0.9, -0.9])
    assert float(terms.total.detach()) == pytest.approx(-(0.85 + 0.9 + 0.9))  # no KL loss term


def test_truncated_importance_sampling_weighs_by_the_capped_sampler_ratio() -> None:
    # Trainer/sampler ratio e^0.5 ≈ 1.65: PPO-clip against the sampler clips it to 1.2 and
    # learns nothing from the token; TIS weighs the trainer's own on-policy term by min(1.65, 1.5).
    loss, grad, _ = _one_token(0.5, 1.0, "grpo")
    assert loss == pytest.approx(-1.2) and grad == 0.0
    loss, grad, terms = _one_token(0.5, 1.0, "grpo", tis_cap=1.5)
    assert loss == pytest.approx(-1.5) and grad == pytest.approx(-1.5)
    loss, grad, _ = _one_token(0.5, 1.0, "grpo", tis_cap=2.0)  # under the cap: the ratio itself
    assert loss == pytest.approx(-math.exp(0.5)) and grad == pytest.approx(-math.exp(0.5))
    # The mismatch metric: k3 of the same ratio, r - 1 - log r.
    assert float(terms.mismatch_kl_sum) == pytest.approx(math.exp(0.5) - 1.5, rel=1e-6)


def test_truncated_importance_sampling_clips_against_the_proximal_policy() -> None:
    # After an earlier optimizer step of the same training step the policy moved e^0.3 away
    # from where the step began (the proximal policy): that ratio is clipped as PPO does.
    logprobs = torch.tensor([[-0.7]], requires_grad=True)
    terms = _loss("grpo", tis_cap=2.0)(
        LossInputs(
            logprobs=logprobs,
            behaviour=torch.tensor([[-1.0]]),
            advantages=torch.tensor([[1.0]]),
            mask=torch.ones(1, 1),
            proximal=torch.tensor([[-1.0]]),
        )
    )
    terms.total.backward()
    assert float(terms.total.detach()) == pytest.approx(-1.2)  # clip(e^0.3) x weight 1
    assert float(logprobs.grad) == 0.0


def test_mismatch_k3_is_zero_when_the_engines_agree_and_positive_otherwise() -> None:
    same = torch.tensor([-1.0, -2.0])
    assert mismatch_k3(same, same).tolist() == [0.0, 0.0]
    assert (mismatch_k3(same, same - 0.3) > 0).all() and (mismatch_k3(same, same + 0.3) > 0).all()


def test_the_overlong_penalty_is_linear_over_the_buffer() -> None:
    assert overlong_shaped(1.0, 48, max_tokens=64, buffer=16, penalty=1.0) == 1.0
    assert overlong_shaped(1.0, 56, max_tokens=64, buffer=16, penalty=1.0) == 0.5
    assert overlong_shaped(1.0, 64, max_tokens=64, buffer=16, penalty=1.0) == 0.0
    assert overlong_shaped(1.0, 90, max_tokens=64, buffer=16, penalty=0.5) == 0.5
    assert overlong_shaped(1.0, 64, max_tokens=64, buffer=0, penalty=1.0) == 1.0  # off


def test_clip_ranges_default_by_algorithm() -> None:
    def clip(**training) -> tuple[float, float]:
        settings = loss_settings(TrainingSpec(**training))
        return settings.clip_low, settings.clip_high

    assert clip() == (0.2, 0.2)
    assert clip(clip_eps=0.1) == (0.1, 0.1)
    assert clip(algorithm="dapo") == (0.2, 0.28)
    assert clip(algorithm="dapo", clip_eps=0.1) == (0.1, 0.28)
    assert clip(algorithm="gspo") == (3e-4, 4e-4)
    assert clip(algorithm="grpo", clip_eps=0.1, clip_eps_high=0.3) == (0.1, 0.3)


def _job(**training) -> dict:
    return {
        "model": {"source": "m"},
        "task_app": {"name": "t"},
        "sampling": {"max_tokens": 32},
        "training": training,
    }


def test_the_job_config_refuses_dapo_options_elsewhere_and_a_buffer_past_max_tokens() -> None:
    with pytest.raises(ValidationError, match=r"\[training.dapo\] applies to algorithm = 'dapo'"):
        JobConfig.model_validate(_job(algorithm="grpo", dapo={"overlong_buffer": 4}))
    with pytest.raises(ValidationError, match=r"must be below sampling\.max_tokens"):
        JobConfig.model_validate(_job(algorithm="dapo", dapo={"overlong_buffer": 32}))
    with pytest.raises(ValidationError, match="algorithm"):
        JobConfig.model_validate(_job(algorithm="ppo"))
    config = JobConfig.model_validate(_job(algorithm="dapo", steps=10, prompts_per_step=4))
    assert config.training.dapo_options is not None  # DAPO's defaults without the section
    # Refills ask new questions: past every step's own seeds, and held out from eval's.
    assert config.refill_seed_index(0, 1, 0) == 40 and config.refill_seed_index(1, 2, 3) == 59
    assert config.training_seeds() == range(0, 160)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.mark.parametrize("algorithm", sorted(LOSSES))
def test_every_algorithm_takes_a_trainer_step_on_policy(model_dir, algorithm: str) -> None:
    from tests.unit.test_trainer import _samples

    config = TrainerConfig.of(
        TrainingSpec(algorithm=algorithm, optimizer=AdamWSpec(lr=1e-2), tis_cap=2.0, minibatches=2)
    )
    trainer = Trainer(model_dir, config)
    samples = _samples(trainer)
    metrics = trainer.step(samples)
    assert math.isfinite(metrics.loss) and metrics.grad_norm > 0
    # Behaviour logprobs are the trainer's own: nothing between sampler and trainer.
    assert metrics.mismatch_kl == pytest.approx(0.0, abs=1e-6)
    # The second optimizer step's ratio is to the policy before the first (the proximal
    # policy), which has moved since: not the 1 that a ratio to itself would be.
    assert metrics.ratio_mean != pytest.approx(1.0, abs=1e-6)
