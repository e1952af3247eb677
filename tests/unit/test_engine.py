"""The torch engine on the tiny model: what only it does (its batch scheduler), and the
tiny model itself. The contract both engines keep is in tests/integration/
test_engine_conformance.py."""

from __future__ import annotations

import asyncio

import pytest

from rlnode.engine import EngineError, GenerationRequest, create_engine, render_chat
from rlnode.engine.torch_engine import TorchEngine
from rlnode.models.build import init_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture
def engine(model_dir):
    return TorchEngine(model_dir, max_batch_size=16, max_wait_ms=20, seed=1)


def _prompt(engine, text: str = "Copy: abca") -> list[int]:
    return render_chat(engine.tokenizer, [{"role": "user", "content": text}])


def test_tiny_model_is_deterministic_and_loadable(tmp_path, model_dir) -> None:
    again = init_tiny_model(tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (
        model_dir / "model.safetensors"
    ).read_bytes()
    other = init_tiny_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (
        model_dir / "model.safetensors"
    ).read_bytes()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.decode(tokenizer("Copy: ab!")["input_ids"]) == "Copy: ab!"


async def test_concurrent_requests_are_batched_and_logprobs_reproduce(engine) -> None:
    prompts = [_prompt(engine, f"Copy: {'ab' * (i % 3 + 1)}") for i in range(12)]
    results = await asyncio.gather(
        *(engine.generate(GenerationRequest(p, max_tokens=6)) for p in prompts)
    )
    assert engine.batches < len(prompts)  # coalesced, not one by one
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.completion_ids) == len(result.logprobs) <= 6
        scored = engine.score_sync([prompt + result.completion_ids])[0][len(prompt) - 1 :]
        assert scored == pytest.approx(result.logprobs, abs=1e-5)  # left padding changes nothing


async def test_batching_off_serves_one_by_one(model_dir) -> None:
    engine = TorchEngine(model_dir, max_batch_size=1)
    await asyncio.gather(
        *(engine.generate(GenerationRequest(_prompt(engine), max_tokens=2)) for _ in range(4))
    )
    assert engine.batches == 4


def test_an_unknown_engine_is_a_clear_error(model_dir) -> None:
    with pytest.raises(EngineError, match="unknown engine 'tensorrt'"):
        create_engine("tensorrt", model_dir)


def test_a_missing_model_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(EngineError, match="cannot load a model from"):
        TorchEngine(tmp_path / "nothing-here")


@pytest.mark.gpu
async def test_cuda_generation_matches_a_cuda_forward_pass(model_dir) -> None:
    engine = TorchEngine(model_dir, device="cuda", dtype="float32")
    prompt = _prompt(engine)
    results = await asyncio.gather(
        *(engine.generate(GenerationRequest(prompt, max_tokens=8)) for _ in range(8))
    )
    for r in results:
        scored = engine.score_sync([prompt + r.completion_ids])[0][len(prompt) - 1 :]
        assert scored == pytest.approx(r.logprobs, abs=1e-4)


async def test_a_scheduler_that_dies_fails_its_requests_says_so_and_starts_again(engine) -> None:
    real = engine._run_batch

    async def dies_once(batch) -> None:
        engine._run_batch = real  # the restarted scheduler batches as before
        raise RuntimeError("a bug in batching")

    engine._run_batch = dies_once
    engine._scheduler.first_delay_s = 0.3
    with pytest.raises(EngineError, match="the scheduler failed: RuntimeError: a bug"):
        await engine.generate(GenerationRequest(_prompt(engine), max_tokens=2))
    assert engine.failures() == {"torch engine scheduler": "RuntimeError: a bug in batching"}
    result = await engine.generate(GenerationRequest(_prompt(engine), max_tokens=2))
    assert result.completion_ids and engine.failures() == {}
    await engine.close()


async def test_the_instant_engine_answers_fixed_tokens_for_the_control_plane_benchmark(
    model_dir,
) -> None:
    """`GENERATOR_ENGINE=instant` (bench/control_plane.py): the model's tokenizer, the same
    completion at once, a prompt the model could not embed still refused."""
    engine = create_engine("instant", model_dir)
    prompt = _prompt(engine)
    first, second = await asyncio.gather(
        *(engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=8)) for _ in range(2))
    )
    assert first.completion_ids == second.completion_ids
    assert engine.tokenizer.decode(first.completion_ids, skip_special_tokens=True) == "abc"
    assert first.finish_reason == "stop" and len(first.logprobs) == len(first.completion_ids)
    cut = await engine.generate(GenerationRequest(prompt_ids=prompt, max_tokens=2))
    assert len(cut.completion_ids) == 2 and cut.finish_reason == "length"
    with pytest.raises(EngineError, match="outside this model's vocabulary"):
        await engine.generate(GenerationRequest(prompt_ids=[10**6]))
