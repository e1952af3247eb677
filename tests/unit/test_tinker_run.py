"""A Tinker API run on the learner's side (rlnode.training.tinker) with the tiny model and
an in-memory transport: calls run in order and are answered; a run restored after a crash
skips what its checkpoint covers and runs the rest again, ending where an uninterrupted run
ends; a call it cannot run is answered with the client's error and the run goes on."""

from __future__ import annotations

import pytest

from rlnode.messages import JobEventType
from rlnode.messages.config import LoraSpec
from rlnode.messages.tinker import (
    CreateRun,
    ForwardBackward,
    LoadWeights,
    OptimStep,
    SaveForSampler,
    SaveWeights,
    TinkerCall,
    TinkerDatum,
)
from rlnode.models.build import init_tiny_model
from rlnode.training.tinker import TinkerRun
from rlnode.training.transport import InMemoryTransport

SEQUENCE = [5, 17, 23, 42, 8, 99, 3, 61]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def _spec(model_dir, lora: bool = True) -> CreateRun:
    return CreateRun(base_model=str(model_dir), lora=LoraSpec(rank=4) if lora else None)


def _calls(spec: CreateRun, run: str = "run-a", org: str = "org-a") -> list[TinkerCall]:
    datum = TinkerDatum(
        input_ids=SEQUENCE[:-1], targets=SEQUENCE[1:], inputs={"weights": [1.0] * 7}
    )
    ops = [
        spec,
        ForwardBackward(datums=[datum], loss_fn="cross_entropy"),
        OptimStep(learning_rate=5e-2),
        SaveWeights(name="first"),
        ForwardBackward(datums=[datum], loss_fn="cross_entropy"),
        OptimStep(learning_rate=5e-2),
        ForwardBackward(datums=[datum], loss_fn="cross_entropy"),
        SaveForSampler(name="sampled"),
    ]
    return [
        TinkerCall(job_id=run, org_id=org, request_id=f"r{i}", seq_id=i, call=op)
        for i, op in enumerate(ops)
    ]


async def _run_calls(run: TinkerRun, calls: list[TinkerCall]) -> list:
    return [await run.execute(c) for c in calls]


async def test_calls_are_answered_in_order_and_the_run_reports_as_a_job(model_dir, tmp_path):
    transport = InMemoryTransport()
    spec = _spec(model_dir)
    run = TinkerRun("run-a", "org-a", spec, tmp_path, ["cpu"], transport)
    await run.start()
    try:
        results = await _run_calls(run, _calls(spec))
    finally:
        await run.close()
    assert [r.error for r in results] == [None] * 8
    first, second = results[1], results[4]
    assert second.loss_sum < first.loss_sum  # one step of cross_entropy lowered the loss
    assert first.tokens == 7 and len(first.logprobs[0]) == 7
    assert results[2].step == 1 and results[5].step == 2 and results[2].grad_norm > 0
    assert set(results[2].timings) == {"forward_backward_s", "optim_step_s"}
    assert results[3].checkpoint == "first"
    assert results[7].weight_version == 1 and results[7].weights_uri.endswith("sampled.safetensors")
    kinds = [e.type for e in transport.events]
    assert kinds.count(JobEventType.TRAIN_STEP) == 2
    assert JobEventType.CHECKPOINT_SAVED in kinds and JobEventType.WEIGHTS_PUBLISHED in kinds
    assert transport.weights[0].adapter == LoraSpec(rank=4)
    root = tmp_path / "org-a" / "run-a"
    assert (root / "checkpoints" / "named-first" / "trainer_state.json").is_file()
    assert (root / "sampler" / "sampled.safetensors").is_file()


async def test_a_restored_run_skips_what_its_checkpoint_covers_and_ends_the_same(
    model_dir, tmp_path
):
    spec = _spec(model_dir, lora=False)
    calls = _calls(spec)
    whole = TinkerRun("run-a", "org-a", spec, tmp_path / "whole", ["cpu"], InMemoryTransport())
    await whole.start()
    try:
        expected = await _run_calls(whole, calls)
        expected_scores = whole.policy.started.score(SEQUENCE)
    finally:
        await whole.close()
    # The learner dies after answering call 6 (a pass after step 2's checkpoint at call 5).
    crashed = TinkerRun("run-a", "org-a", spec, tmp_path / "crash", ["cpu"], InMemoryTransport())
    await crashed.start()
    await _run_calls(crashed, calls[:7])
    assert crashed.checkpointed_seq == 5 and crashed.settled(5) and not crashed.settled(6)
    await crashed.close()
    restored = TinkerRun("run-a", "org-a", spec, tmp_path / "crash", ["cpu"], InMemoryTransport())
    await restored.start()
    try:
        assert restored.steps == 2 and restored.last_seq == 5
        # Kafka hands it every call after the committed offset (here: all of them again).
        again = await _run_calls(restored, calls)
        assert again[:6] == [None] * 6  # covered by the checkpoint: not run twice
        assert again[6].loss_sum == pytest.approx(expected[6].loss_sum, rel=1e-5)
        scores = restored.policy.started.score(SEQUENCE)
    finally:
        await restored.close()
    assert scores == pytest.approx(expected_scores, abs=1e-5)


async def test_a_call_it_cannot_run_is_the_clients_error_and_the_run_goes_on(model_dir, tmp_path):
    spec = _spec(model_dir)
    run = TinkerRun("run-b", "org-a", spec, tmp_path, ["cpu"], InMemoryTransport())
    await run.start()
    datum = TinkerDatum(input_ids=[1, 2, 3], targets=[2, 3, 4], inputs={"weights": [1.0] * 3})
    ops = [
        ForwardBackward(datums=[datum], loss_fn="gspo"),
        ForwardBackward(datums=[datum], loss_fn="ppo"),
        LoadWeights(source_run="run-b", name="missing"),
        ForwardBackward(datums=[datum], loss_fn="cross_entropy"),
        SaveWeights(name="kept"),
        LoadWeights(source_run="run-b", name="kept", with_optimizer=False),
    ]
    calls = [
        TinkerCall(job_id="run-b", org_id="org-a", request_id=f"r{i}", seq_id=i, call=op)
        for i, op in enumerate(ops)
    ]
    try:
        results = await _run_calls(run, calls)
    finally:
        await run.close()
    assert "choose one of cross_entropy" in results[0].error
    assert "datum 0 has no logprobs, advantages" in results[1].error
    assert "there is no checkpoint 'missing' of run run-b" in results[2].error
    assert {r.error_category for r in results[:3]} == {"user"}
    assert [r.error for r in results[3:]] == [None] * 3


def test_datums_with_misaligned_inputs_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="weights has 2 values for 3 input tokens"):
        TinkerDatum(input_ids=[1, 2, 3], targets=[2, 3, 4], inputs={"weights": [1.0, 1.0]})
