"""Samples that share a prompt trained as one packed row: the same logprobs and gradients as a
row each, for fewer tokens; groups kept whole by the micro-batching, split at the budget."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlnode.messages import TrainingSpec
from rlnode.messages.config import AdamWSpec
from rlnode.models.build import init_tiny_model
from rlnode.models.hf import load_causal_lm
from rlnode.training.grpo import Sample
from rlnode.training.losses.tinker import TokenLoss
from rlnode.training.shared_prompts import (
    LONGEST_RUN,
    pack,
    pack_sequences,
    packed_tokens,
    prefix_rows,
    prompt_groups,
)
from rlnode.training.trainer import (
    CompletionLogprobs,
    TokenDatum,
    Trainer,
    TrainerConfig,
    completion_logprobs,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def _groups() -> list[Sample]:
    """Two prompts of different lengths, each with completions of 1 to 6 tokens, one of them
    a merged multi-turn sample (environment tokens not trained); interleaved, as samples of
    two groups may arrive."""
    prompts = [[3, 9, 14, 15, 26], [5, 35, 8]]
    completions = [[40, 41, 42, 2], [43], [44, 45, 46, 47, 48, 2], [49, 50]]
    samples = []
    for k, completion in enumerate(completions):
        for g, prompt in enumerate(prompts):
            mask = [True, False, False, True] if k == 0 and g == 1 else None
            advantage = (1.0 if (k + g) % 2 else -1.0) * (k + 1) / 4
            samples.append(
                Sample(list(prompt), list(completion), [-1.0] * len(completion), advantage, None)
            )
            samples[-1].loss_mask = mask
    return samples


def test_a_packed_row_holds_the_prompt_once_and_each_completion_but_its_last_token() -> None:
    samples = _groups()
    packed = pack(samples, pad_id=0)
    assert packed.input_ids.shape == (2, 5 + 3 + 0 + 5 + 1)  # the longer prompt's row
    assert packed.input_ids[0, :5].tolist() == [3, 9, 14, 15, 26]
    assert packed.input_ids[0, 5:8].tolist() == [40, 41, 42]
    # Each completion starts at the prompt's length, wherever it sits in the row.
    assert packed.position_ids[0, 5:8].tolist() == [5, 6, 7]
    assert packed.position_ids[0, 8:13].tolist() == [5, 6, 7, 8, 9]
    allowed = packed.allowed[0, 0]
    assert allowed[8, :5].all() and allowed[8, 8] and not allowed[8, 5:8].any()
    assert not allowed[:5, 5:].any()  # the prompt sees none of the completions
    # The trained tokens: every one but the merged sample's two environment tokens.
    assert len(packed.targets) == 2 * (4 + 1 + 6 + 2) - 2
    assert packed_tokens(samples) == 2 * 14 < sum(s.tokens for s in samples)


def test_packed_logprobs_and_gradients_equal_a_row_per_sample(model_dir) -> None:
    trainer = Trainer(model_dir, TrainerConfig.of(TrainingSpec(optimizer=AdamWSpec(lr=1e-2))))
    samples = _groups()
    results = []
    for share in (True, False):
        trainer.optimizer.zero_grad(set_to_none=True)
        logprobs, mask = completion_logprobs(trainer.policy, samples, "cpu", 0.7, 0, share)
        advantages = torch.tensor([s.advantage for s in samples]).unsqueeze(-1)
        (logprobs * mask * advantages).sum().backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        results.append((logprobs.detach(), mask, grads))
    (packed, packed_mask, packed_grads), (rows, rows_mask, rows_grads) = results
    assert torch.equal(packed_mask, rows_mask)
    assert torch.allclose(packed, rows, atol=1e-5)
    assert (packed[rows_mask == 0] == 0).all()
    for name, grad in rows_grads.items():  # float rounding of sums taken in another order
        assert torch.allclose(packed_grads[name], grad, rtol=1e-4, atol=1e-6 * grad.abs().max())


def test_eager_attention_takes_the_block_mask_as_an_additive_one(model_dir) -> None:
    sdpa = CompletionLogprobs(load_causal_lm(model_dir, dtype=torch.float32), 64)
    eager = CompletionLogprobs(
        load_causal_lm(model_dir, dtype=torch.float32, attn_implementation="eager"), 64
    )
    assert sdpa.takes_block_masks and eager.takes_block_masks
    samples = _groups()
    with torch.no_grad():
        shared, _ = completion_logprobs(eager, samples, "cpu", 1.0, 0)
        alone, _ = completion_logprobs(sdpa, samples, "cpu", 1.0, 0, share_prompts=False)
    assert torch.allclose(shared, alone, atol=1e-5)


def test_a_training_step_is_the_same_packed_or_not(model_dir) -> None:
    samples = _groups()
    packed, rows = (
        Trainer(model_dir, TrainerConfig.of(TrainingSpec(optimizer=AdamWSpec(lr=1e-2)))),
        Trainer(
            model_dir,
            TrainerConfig.of(TrainingSpec(optimizer=AdamWSpec(lr=1e-2), share_prompts=False)),
        ),
    )
    assert packed.share_prompts and not rows.share_prompts
    a, b = packed.step(samples), rows.step(samples)
    assert a.loss == pytest.approx(b.loss, rel=1e-5) and a.tokens == b.tokens
    for x, y in zip(packed.model.parameters(), rows.model.parameters(), strict=True):
        assert torch.allclose(x.grad, y.grad, rtol=1e-4, atol=1e-6 * y.grad.abs().max())


def test_groups_stay_whole_in_micro_batches_and_split_only_past_the_budget(model_dir) -> None:
    samples = _groups()
    groups = prompt_groups(samples, token_budget=1000)
    assert [len(g.samples) for g in groups] == [4, 4]
    assert all(len({tuple(s.prompt_ids) for s in g.samples}) == 1 for g in groups)
    # A budget of 10 tokens: the 5-token prompt's group (14 packed) splits, each part <= 10
    # or a single sample.
    split = prompt_groups(samples, token_budget=10)
    assert sum(len(g.samples) for g in split) == len(samples)
    assert all(g.tokens <= 10 or len(g.samples) == 1 for g in split)
    trainer = Trainer(
        model_dir,
        TrainerConfig.of(TrainingSpec(optimizer=AdamWSpec(lr=1e-2), tokens_per_micro_batch=16)),
    )
    batches = trainer._sample_batches(samples)
    assert sorted(id(s) for b in batches for s in b) == sorted(id(s) for s in samples)
    assert all(packed_tokens(b) <= 16 for b in batches)


def _datums() -> list[TokenDatum]:
    """`_groups`' samples as the Tinker API's datums: the whole sequence in, each next token
    the target, weighted on the completion (and, for one, on its prompt too: a prefix
    position with a gradient from one datum and not from the others)."""
    datums = []
    for n, s in enumerate(_groups()):
        sequence = s.prompt_ids + s.completion_ids
        weights = [0.0] * (len(s.prompt_ids) - 1) + [s.advantage] * len(s.completion_ids)
        if n == 2:
            weights[: len(s.prompt_ids) - 1] = [0.5] * (len(s.prompt_ids) - 1)
        datums.append(TokenDatum(sequence[:-1], sequence[1:], {"weights": weights}))
    return datums


def test_datums_on_a_shared_prompt_pass_as_one_row_with_the_same_logprobs_and_gradients(
    model_dir,
) -> None:
    datums = _datums()
    packed = pack_sequences([d.input_ids for d in datums], [d.targets for d in datums], 0)
    assert packed.input_ids.shape[0] == 2  # one row per prompt
    assert packed.padded_tokens < len(datums) * max(d.tokens for d in datums)
    shared, alone = (
        Trainer(model_dir, TrainerConfig.of(TrainingSpec(optimizer=AdamWSpec(lr=1e-2)))),
        Trainer(
            model_dir,
            TrainerConfig.of(TrainingSpec(optimizer=AdamWSpec(lr=1e-2), share_prompts=False)),
        ),
    )
    loss = TokenLoss.of("cross_entropy")
    a, b = shared.forward_backward(datums, loss), alone.forward_backward(datums, loss)
    assert a.loss_sum == pytest.approx(b.loss_sum, rel=1e-5) and a.tokens == b.tokens
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x == pytest.approx(y, abs=1e-5)
    for x, y in zip(shared.model.parameters(), alone.model.parameters(), strict=True):
        assert torch.allclose(x.grad, y.grad, rtol=1e-4, atol=1e-6 * y.grad.abs().max())


def test_sequences_share_a_row_only_where_that_computes_fewer_tokens() -> None:
    template = [1, 2, 3]  # what every conversation opens with
    groups = [[[*template, p, 8, 9, 10, 11, c, c + 1] for c in (20, 30, 40)] for p in (6, 7)]
    other = [*template, 5, 51, 52, 53, 54, 55]  # sorted first, sharing only the template
    sequences = [*groups[0], other, *groups[1]]
    packed = pack_sequences(sequences, [[*s[1:], 0] for s in sequences], 0)
    # Each group's prompt (8 tokens) once and each completion's 2; the other sequence a row
    # of its own: joined on the template, every row would repeat its prompt.
    assert packed.input_ids.shape == (3, 8 + 3 * 2)
    assert [len(r) for r in packed.reads] == [len(s) for s in sequences]
    rows = prefix_rows(sequences, token_budget=10)  # a group's row (14) split at the budget
    assert sorted(m for r in rows for m in r.members) == list(range(len(sequences)))
    assert all(r.tokens <= 10 or len(r.members) == 1 for r in rows)


def test_identical_sequences_pack_in_rows_of_at_most_the_longest_run() -> None:
    sequences = [[1, 2, 3, 4]] * (2 * LONGEST_RUN + 1)
    packed = pack_sequences(sequences, [[2, 3, 4, 5]] * len(sequences), 0)
    assert packed.input_ids.shape == (3, 4)  # each row the sequence once
    assert len(packed.rows) == 3 * 4 and len({tuple(r) for r in packed.reads}) == 3
