"""The Tinker API's losses per token, against numbers worked by hand from the formulas in
its documentation (rlnode.training.losses.tinker), and the trainer's passes that use them:
summed, never normalised, accumulated until an optimizer step."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from rlnode.messages import TrainingSpec
from rlnode.messages.config import AdamWSpec
from rlnode.models.build import init_tiny_model
from rlnode.training.distributed import DataParallelTrainer
from rlnode.training.losses.tinker import LossRefused, TokenLoss
from rlnode.training.trainer import TokenDatum, Trainer, TrainerConfig

# Three tokens: the trained model's logprobs, the sampler's, and advantages.
LOGP = [-1.0, -2.0, -1.0]
SAMPLED = [-1.5, -1.0, -1.1]
ADVANTAGES = [2.0, -1.0, 1.0]
# ratio = exp(logp - q): e^0.5, e^-1, e^0.1
R = [math.exp(0.5), math.exp(-1.0), math.exp(0.1)]


def _losses(name: str, config=None, **inputs) -> tuple[list[float], list[float]]:
    """Per-token losses and d(sum)/d(logp)."""
    logp = torch.tensor(LOGP, requires_grad=True)
    given = {"logprobs": SAMPLED, "advantages": ADVANTAGES, **inputs}
    tensors = {k: torch.tensor(v) for k, v in given.items()}
    out = TokenLoss.of(name, config).per_token(logp, tensors)
    out.sum().backward()
    assert logp.grad is not None
    return out.tolist(), logp.grad.tolist()


def test_cross_entropy_is_minus_the_signed_weights_times_logprobs() -> None:
    loss, grad = _losses("cross_entropy", weights=[1.0, -0.5, 0.0])
    assert loss == pytest.approx([1.0, -1.0, 0.0])
    assert grad == pytest.approx([-1.0, 0.5, 0.0])  # a negative weight pushes the token down


def test_importance_sampling_weights_the_advantage_by_the_ratio() -> None:
    loss, grad = _losses("importance_sampling")
    assert loss == pytest.approx([-R[0] * 2.0, R[1] * 1.0, -R[2]])
    assert grad == pytest.approx(loss)  # d/dlogp of -(e^(logp-q) A) is itself


def test_ppo_takes_the_pessimistic_side_of_the_clip_at_0_8_and_1_2() -> None:
    loss, grad = _losses("ppo")
    # token 0: min(1.6487 * 2, 1.2 * 2); token 1: min(0.3679 * -1, 0.8 * -1); token 2 inside.
    assert loss == pytest.approx([-2.4, 0.8, -R[2]])
    assert grad == pytest.approx([0.0, 0.0, -R[2]])  # clipped tokens carry no gradient


def test_ppo_and_cispo_thresholds_come_from_the_datum_then_the_config() -> None:
    loss, _ = _losses("ppo", {"clip_high_threshold": 1.05})
    assert loss == pytest.approx([-1.05 * 2.0, 0.8, -1.05])
    loss, _ = _losses("ppo", {"clip_high_threshold": 1.05}, clip_high_threshold=[2.0, 2.0, 2.0])
    assert loss == pytest.approx([-R[0] * 2.0, 0.8, -R[2]])


def test_cispo_is_the_detached_clipped_ratio_times_logprob_times_advantage() -> None:
    loss, grad = _losses("cispo")  # defaults 0.0 and 4.0: nothing here is clipped
    assert loss == pytest.approx([-R[0] * -1.0 * 2.0, -R[1] * -2.0 * -1.0, -R[2] * -1.0])
    assert grad == pytest.approx([-R[0] * 2.0, R[1], -R[2]])  # the ratio is a constant
    loss, grad = _losses("cispo", {"clip_high_threshold": 1.2})
    assert loss[0] == pytest.approx(-1.2 * -1.0 * 2.0) and grad[0] == pytest.approx(-2.4)


def test_dro_penalises_the_squared_log_ratio_by_beta() -> None:
    loss, grad = _losses("dro", {"beta": 0.5})
    # -(logp A - beta/2 (logp - q)^2): -(-2 - 0.25 * 0.25), -(2 - 0.25 * 1), -(-1 - 0.25 * 0.01)
    assert loss == pytest.approx([2.0625, -1.75, 1.0025])
    # -(A - beta (logp - q))
    assert grad == pytest.approx([-(2.0 - 0.25), -(-1.0 + 0.5), -(1.0 - 0.05)])


@pytest.mark.parametrize(
    ("name", "config", "says"),
    [
        ("gspo", None, "choose one of cross_entropy, importance_sampling, ppo, cispo, dro"),
        ("custom", None, "forward_backward_custom runs on top of cross_entropy"),
        ("dro", None, "dro needs loss_fn_config={'beta': ...}"),
        ("ppo", {"beta": 0.1}, "loss_fn_config for ppo has 'beta'; it takes clip_low_threshold"),
        ("cross_entropy", {"x": 1}, "it takes no keys"),
        ("ppo", {"clip_low_threshold": "low"}, "must be a number, got 'low'"),
    ],
)
def test_a_loss_or_config_it_does_not_take_is_refused_naming_what_it_takes(
    name, config, says
) -> None:
    with pytest.raises(LossRefused) as refused:
        TokenLoss.of(name, config)
    assert says in str(refused.value)


def test_a_datum_without_the_inputs_its_loss_reads_is_refused() -> None:
    with pytest.raises(LossRefused) as refused:
        TokenLoss.of("ppo").check_inputs({"target_tokens", "logprobs"}, datum=3)
    assert "datum 3 has no advantages" in str(refused.value)


# -- the trainer's passes, on the tiny model ---------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def _trainer(model_dir, **changes) -> Trainer:
    spec = TrainingSpec(
        **{"optimizer": AdamWSpec(lr=1e-2), "tokens_per_micro_batch": 4096, **changes}
    )
    return Trainer(model_dir, TrainerConfig.of(spec))


def _datum(sequence: list[int], weights: list[float] | None = None) -> TokenDatum:
    weights = weights if weights is not None else [1.0] * (len(sequence) - 1)
    return TokenDatum(sequence[:-1], sequence[1:], {"weights": weights})


SEQUENCES = [[5, 17, 23, 42, 8, 99], [7, 7, 31, 2], [64, 3, 11, 12, 13, 14, 15, 90]]


def test_a_pass_scores_every_target_and_sums_the_loss_unnormalised(model_dir) -> None:
    trainer = _trainer(model_dir)
    datums = [_datum(s) for s in SEQUENCES]
    whole = trainer.forward_backward(datums, TokenLoss.of("cross_entropy"), backward=False)
    for sequence, logprobs in zip(SEQUENCES, whole.logprobs, strict=True):
        assert logprobs == pytest.approx(trainer.score(sequence), abs=1e-5)
    assert whole.loss_sum == pytest.approx(-sum(map(sum, whole.logprobs)), rel=1e-5)
    each = [trainer.forward_backward([d], TokenLoss.of("cross_entropy"), False) for d in datums]
    assert whole.loss_sum == pytest.approx(sum(p.loss_sum for p in each), rel=1e-5)
    assert whole.tokens == sum(len(s) - 1 for s in SEQUENCES)


def test_gradients_add_up_across_passes_until_the_optimizer_step(model_dir) -> None:
    one_pass, three_passes = _trainer(model_dir), _trainer(model_dir, tokens_per_micro_batch=8)
    loss = TokenLoss.of("cross_entropy")
    one_pass.forward_backward([_datum(s) for s in SEQUENCES], loss)
    for s in SEQUENCES:
        three_passes.forward_backward([_datum(s)], loss)
    norms = [t.optim_step(1e-3) for t in (one_pass, three_passes)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-4) and norms[0] > 0
    for a, b in zip(one_pass.model.parameters(), three_passes.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_passes_on_a_bf16_copy_of_the_weights_add_up_in_the_fp32_masters(model_dir) -> None:
    fp32 = _trainer(model_dir)
    copied = _trainer(
        model_dir,
        compute_dtype="bfloat16",
        weights_in_compute_dtype=True,
        tokens_per_micro_batch=8,
    )
    loss = TokenLoss.of("cross_entropy")
    fp32.forward_backward([_datum(s) for s in SEQUENCES], loss)
    for s in SEQUENCES:
        copied.forward_backward([_datum(s)], loss)
    assert all(p.grad is None for p in copied.compute_model.parameters())
    norms = [t.optim_step(1e-3) for t in (fp32, copied)]
    assert norms[1] == pytest.approx(norms[0], rel=0.02) and norms[0] > 0
    pairs = zip(copied.model.parameters(), copied.compute_model.parameters(), strict=True)
    assert all(torch.equal(copy, master.to(torch.bfloat16)) for master, copy in pairs)


def test_a_forward_only_pass_leaves_nothing_for_the_optimizer(model_dir) -> None:
    trainer = _trainer(model_dir)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.forward_backward([_datum(SEQUENCES[0])], TokenLoss.of("cross_entropy"), False)
    trainer.optim_step(1e-2)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_zero_weights_train_nothing_and_signed_weights_push_down(model_dir) -> None:
    trainer = _trainer(model_dir)
    sequence = SEQUENCES[0]
    before = trainer.score(sequence)
    weights = [0.0] * (len(sequence) - 2) + [-1.0]  # only the last token, pushed down
    trainer.forward_backward([_datum(sequence, weights)], TokenLoss.of("cross_entropy"))
    trainer.optim_step(1e-2, grad_clip_norm=1.0)
    after = trainer.score(sequence)
    assert after[-1] < before[-1]


def test_positions_without_a_gradient_and_kept_activations_change_nothing(model_dir) -> None:
    """Logprobs of positions a loss has no gradient at are computed without one, and short
    passes keep their activations: the same logprobs and the same step as differentiating
    every position and recomputing every layer."""
    # The second datum is of a group of equal rewards: no gradient anywhere, scored alone.
    advantages = [[0.0] * 3 + [1.0, -0.5], [0.0, 0.0, 0.0], [0.0] * 5 + [1.0, 0.0]]
    datums = [
        TokenDatum(s[:-1], s[1:], {"logprobs": [-2.0] * (len(s) - 1), "advantages": a})
        for s, a in zip(SEQUENCES, advantages, strict=True)
    ]
    loss = TokenLoss.of("importance_sampling")
    assert loss.differentiated(datums[0].inputs, 5) == [False] * 3 + [True] * 2
    assert TokenLoss.of("dro", {"beta": 0.1}).differentiated(datums[1].inputs, 3) == [True] * 3

    class EveryPosition(TokenLoss):  # the loss, with no position left out
        def differentiated(self, inputs, tokens):
            return [True] * tokens

    everywhere = EveryPosition("importance_sampling", {})
    trainers, passes = [], []
    for chosen, recompute_from in ((everywhere, 0), (loss, 0), (loss, 10**6)):
        trainer = _trainer(model_dir, activation_checkpointing=True)
        trainer.config = replace(trainer.config, recompute_from_tokens=recompute_from)
        passes.append(trainer.forward_backward(datums, chosen))
        trainer.optim_step(1e-2)
        trainers.append(trainer)
    for other, trainer in zip(passes[1:], trainers[1:], strict=True):
        assert other.loss_sum == pytest.approx(passes[0].loss_sum, rel=1e-5)
        for a, b in zip(other.logprobs, passes[0].logprobs, strict=True):
            assert a == pytest.approx(b, abs=1e-5)
        for a, b in zip(trainer.model.parameters(), trainers[0].model.parameters(), strict=True):
            assert torch.allclose(a, b, atol=1e-6)
    assert not torch.equal(
        next(trainers[0].model.parameters()), next(_trainer(model_dir).model.parameters())
    )
    # A pass whose every advantage is 0 (a group of equal rewards) trains nothing, and fails
    # nothing.
    flat = [
        TokenDatum(d.input_ids, d.targets, {**d.inputs, "advantages": [0.0] * d.tokens})
        for d in datums
    ]
    assert trainers[1].forward_backward(flat, loss).loss_sum == 0.0


def test_over_two_ranks_a_pass_and_a_step_equal_one_process(model_dir) -> None:
    spec = TrainingSpec(optimizer=AdamWSpec(lr=1e-2), tokens_per_micro_batch=4096)
    single = Trainer(model_dir, TrainerConfig.of(spec))  # before the process group exists
    loss, datums = TokenLoss.of("cross_entropy"), [_datum(s) for s in SEQUENCES]
    expected = single.forward_backward(datums, loss)
    single.optim_step(1e-2)
    parallel = DataParallelTrainer(model_dir, TrainerConfig.of(spec), ["cpu", "cpu"])
    try:  # three datums: one rank gets two, the other one
        got = parallel.forward_backward(datums, loss)
        parallel.optim_step(1e-2)
        assert got.loss_sum == pytest.approx(expected.loss_sum, rel=1e-5)
        for a, b in zip(got.logprobs, expected.logprobs, strict=True):
            assert a == pytest.approx(b, abs=1e-5)
        assert parallel.score(SEQUENCES[2]) == pytest.approx(single.score(SEQUENCES[2]), abs=1e-4)
    finally:
        parallel.close()
