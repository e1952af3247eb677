"""Multi-turn trajectories trained as one sequence: turns that extend each other merge into
one sample whose environment tokens are masked out, with the same logprobs at the model's
tokens as a sample per turn; turns that do not fall back to a sample per turn."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rlnode.engine.torch_engine import TorchEngine
from rlnode.examples import example_job
from rlnode.examples.taskapps import guess_number
from rlnode.messages import JobEventType, TokenTurn, TrainingSpec, Trajectory
from rlnode.messages.config import AdamWSpec
from rlnode.models.build import init_tiny_model
from rlnode.training.grpo import (
    Sample,
    merge_turns,
    sample_batch,
    samples_from,
    trained_tokens,
)
from rlnode.training.inprocess import InProcessGenerator
from rlnode.training.loop import JobRunner
from rlnode.training.trainer import Trainer, TrainerConfig, completion_logprobs
from rlnode.training.transport import InMemoryTransport
from tests.factories import trajectory

PROMPT = [5, 6, 7]
# Turn by turn: the model's tokens, their logprobs, then what the environment appended.
MODEL = [[10, 11], [12], [13, 14]]
LOGPROBS = [[-1.0, -2.0], [-3.0], [-4.0, -5.0]]
ENVIRONMENT = [[20, 21, 22], [23]]


def _turns(ref: bool = True, versions: tuple[int, ...] = (3, 2, 3)) -> list[TokenTurn]:
    turns, prompt = [], list(PROMPT)
    for k, (completion, logprobs) in enumerate(zip(MODEL, LOGPROBS, strict=True)):
        turns.append(
            TokenTurn(
                prompt_ids=prompt,
                completion_ids=completion,
                logprobs=logprobs,
                ref_logprobs=[x / 2 for x in logprobs] if ref else None,
                policy_version=versions[k],
                finish_reason="stop",
            )
        )
        prompt = prompt + completion + (ENVIRONMENT[k] if k < len(ENVIRONMENT) else [])
    return turns


def _trajectory(turns: list[TokenTurn]) -> Trajectory:
    return trajectory(turns=turns, group_id="g")


def test_turns_that_extend_each_other_are_one_sample_with_the_environment_masked() -> None:
    t = _trajectory(_turns())
    (s,) = merge_turns(t, 0.5) or []
    assert s.prompt_ids == PROMPT
    assert s.completion_ids == [10, 11, 20, 21, 22, 12, 23, 13, 14]
    assert s.loss_mask == [True, True, False, False, False, True, False, True, True]
    assert s.behaviour_logprobs == [-1.0, -2.0, 0.0, 0.0, 0.0, -3.0, 0.0, -4.0, -5.0]
    assert s.ref_logprobs == [-0.5, -1.0, 0.0, 0.0, 0.0, -1.5, 0.0, -2.0, -2.5]
    assert s.advantage == 0.5 and s.trajectory_id == str(t.id)
    assert s.policy_version == 2  # the oldest turn's: staleness counts the worst
    # The row is the last turn's prompt and completion, once.
    last = t.turns[-1]
    assert s.tokens == len(last.prompt_ids) + len(last.completion_ids)
    assert trained_tokens(s) == 5 == sum(len(c) for c in MODEL)

    batch = sample_batch([t], {str(t.id): 0.5})
    assert batch.samples == [s]
    assert (batch.merged_trajectories, batch.per_turn_trajectories) == (1, 0)


def test_reference_logprobs_are_kept_only_when_every_turn_carried_them() -> None:
    turns = _turns()
    turns[1] = turns[1].model_copy(update={"ref_logprobs": None})
    (s,) = merge_turns(_trajectory(turns), 1.0) or []
    assert s.ref_logprobs is None and s.loss_mask is not None


@pytest.mark.parametrize(
    "rewrite",
    [
        lambda p: p[:2] + p[3:],  # the history truncated
        lambda p: [*p[:4], 99, *p[5:]],  # a model token rewritten (re-tokenised)
        lambda p: p[:4],  # shorter than the previous prompt and completion
    ],
)
def test_turns_that_do_not_extend_each_other_are_a_sample_per_turn(rewrite) -> None:
    turns = _turns()
    turns[2] = turns[2].model_copy(update={"prompt_ids": rewrite(turns[2].prompt_ids)})
    t = _trajectory(turns)
    assert merge_turns(t, 1.0) is None
    batch = sample_batch([t], {str(t.id): 1.0})
    assert (batch.merged_trajectories, batch.per_turn_trajectories) == (0, 1)
    assert [(s.prompt_ids, s.completion_ids, s.behaviour_logprobs) for s in batch.samples] == [
        (turn.prompt_ids, turn.completion_ids, turn.logprobs) for turn in turns
    ]
    assert all(s.loss_mask is None for s in batch.samples)


def test_a_single_turn_is_the_sample_it_always_was() -> None:
    (turn,) = _turns()[:1]
    t = _trajectory([turn])
    batch = sample_batch([t], {str(t.id): 1.0})
    assert batch.samples == [
        Sample(
            turn.prompt_ids,
            turn.completion_ids,
            turn.logprobs,
            1.0,
            turn.ref_logprobs,
            turn.policy_version,
            str(t.id),
        )
    ]
    assert batch.samples[0].loss_mask is None and trained_tokens(batch.samples[0]) == 2
    assert (batch.merged_trajectories, batch.per_turn_trajectories) == (0, 0)


def test_merging_can_be_turned_off_and_samples_from_merges() -> None:
    t = _trajectory(_turns())
    per_turn = sample_batch([t], {str(t.id): 1.0}, merge=False)
    assert len(per_turn.samples) == 3 and per_turn.per_turn_trajectories == 1
    assert len(samples_from([t], {str(t.id): 1.0})) == 1


def test_turns_that_sampled_nothing_make_no_sample() -> None:
    turns = [
        turn.model_copy(update={"completion_ids": [], "logprobs": [], "ref_logprobs": None})
        for turn in _turns()[:1]
    ]
    assert merge_turns(_trajectory(turns), 1.0) == []


# -- on the trainer ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def trainer(model_dir) -> Trainer:
    return Trainer(model_dir, TrainerConfig.of(TrainingSpec(optimizer=AdamWSpec(lr=1e-2))))


def _logprobs(trainer: Trainer, batch: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    return completion_logprobs(trainer.policy, batch, "cpu", 1.0, trainer.pad_id)


def test_a_merged_sample_has_the_per_turn_logprobs_at_the_models_tokens(trainer) -> None:
    t = _trajectory(_turns())
    (merged,) = samples_from([t], {str(t.id): 1.0})
    per_turn = sample_batch([t], {str(t.id): 1.0}, merge=False).samples
    with torch.no_grad():
        logprobs, mask = _logprobs(trainer, [merged])
        turn_logprobs, turn_mask = _logprobs(trainer, per_turn)
    assert mask[0].tolist() == [float(m) for m in merged.loss_mask or []]
    at_model = logprobs[0][mask[0].bool()]
    expected = turn_logprobs[turn_mask.bool()]  # row by row: the turns in order
    assert at_model.shape == (5,) and torch.allclose(at_model, expected, atol=1e-5)
    assert (logprobs[0][~mask[0].bool()] == 0).all()  # not computed for the environment's


def test_the_loss_of_a_merged_sample_has_no_gradient_from_the_environments_tokens(
    trainer,
) -> None:
    """The merged sample's loss and gradient are the per-turn samples' (which never saw the
    environment's tokens as completion), whatever its behaviour logprobs say there."""
    t = _trajectory(_turns())
    (merged,) = samples_from([t], {str(t.id): 1.0})
    assert merged.loss_mask is not None
    merged.behaviour_logprobs = [
        x if keep else 7.0
        for x, keep in zip(merged.behaviour_logprobs, merged.loss_mask, strict=True)
    ]
    per_turn = sample_batch([t], {str(t.id): 1.0}, merge=False).samples

    def gradient(batch: list[Sample]) -> tuple[float, list[torch.Tensor]]:
        trainer.optimizer.zero_grad(set_to_none=True)
        logprobs, mask = _logprobs(trainer, batch)
        behaviour = torch.zeros_like(logprobs)
        for row, s in enumerate(batch):
            behaviour[row, : len(s.behaviour_logprobs)] = torch.tensor(s.behaviour_logprobs)
        advantages = torch.tensor([[s.advantage] for s in batch])
        # The importance-weighted policy gradient every loss of the GRPO family builds on.
        ratio = torch.exp((logprobs - behaviour) * mask)
        loss = -(ratio * advantages * mask).sum()
        loss.backward()
        assert float(mask.sum()) == sum(trained_tokens(s) for s in batch)
        return float(loss.detach()), [p.grad.clone() for p in trainer.policy.parameters()]

    merged_loss, merged_grads = gradient([merged])
    turn_loss, turn_grads = gradient(per_turn)
    assert merged_loss == pytest.approx(turn_loss, rel=1e-5)
    for a, b in zip(merged_grads, turn_grads, strict=True):  # float noise: ~1e-7 of ~1
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_job_loop_reports_how_guess_number_episodes_were_trained(model_dir, tmp_path) -> None:
    job = example_job(
        "copy_task", model_dir, steps=1, prompts_per_step=1, group_size=4, checkpoint_every=100
    )
    job = job.model_copy(
        update={
            "task_app": job.task_app.model_copy(update={"env_config": {"max_turns": 3}}),
            "sampling": job.sampling.model_copy(update={"max_tokens": 4}),
        }
    )
    transport = InMemoryTransport()
    runner = JobRunner("multi-turn", "org", job, transport, tmp_path, ["cpu"], 60.0)
    delivered: list[Trajectory] = []

    def deliver(trajectory: Trajectory) -> None:
        delivered.append(trajectory)
        runner.offer(trajectory)

    async def run() -> None:
        engine = TorchEngine(model_dir, dtype="float32", max_wait_ms=1)
        generator = InProcessGenerator(engine, guess_number.DEFINITION, deliver).attach(transport)
        try:
            await runner.run()
        finally:
            await generator.close()
            await engine.close()

    asyncio.run(run())
    (step,) = [e.data for e in transport.events if e.type is JobEventType.TRAIN_STEP]
    multi_turn = [t for t in delivered if t.status == "ok" and len(t.turns) > 1]
    assert multi_turn  # the guesses of a random model are wrong
    assert step["merged_trajectories"] + step["per_turn_trajectories"] == len(multi_turn)
    assert step["merged_trajectories"] == sum(merge_turns(t, 1.0) is not None for t in multi_turn)
