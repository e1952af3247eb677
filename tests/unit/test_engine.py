"""The torch engine on the tiny model: batching, sampling controls, logprobs, weight loads."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import save_file

from rlnode.engine import EngineError, GenerationRequest, create_engine, render_chat
from rlnode.engine.torch_engine import TorchEngine
from rlnode.models.tiny import init_tiny_model


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


async def test_temperature_zero_is_greedy_and_repeatable(engine) -> None:
    prompt = _prompt(engine)
    a = await engine.generate(GenerationRequest(prompt, max_tokens=5, temperature=0))
    b = await engine.generate(GenerationRequest(prompt, max_tokens=5, temperature=0))
    assert a.completion_ids == b.completion_ids and a.finish_reason == "length"
    scored = engine.score_sync([prompt + a.completion_ids])[0][len(prompt) - 1 :]
    assert scored == pytest.approx(a.logprobs, abs=1e-5)


async def test_temperature_scales_the_logprobs(engine) -> None:
    prompt = _prompt(engine)
    hot = await engine.generate(GenerationRequest(prompt, max_tokens=4, temperature=2.0))
    scored = engine.score_sync([prompt + hot.completion_ids], temperature=2.0)[0][len(prompt) - 1 :]
    assert scored == pytest.approx(hot.logprobs, abs=1e-5)


async def test_top_p_keeps_sampling_inside_the_nucleus(engine) -> None:
    prompt = _prompt(engine)
    with torch.inference_mode():
        probs = torch.softmax(
            engine.model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1
        )
    ordered = probs.sort(descending=True)
    cumulative = ordered.values.cumsum(0)
    nucleus = set(ordered.indices[: int((cumulative < 0.2).sum()) + 1].tolist())
    assert 1 <= len(nucleus) < len(probs) // 2  # a real restriction on this near-uniform model
    results = await asyncio.gather(
        *(engine.generate(GenerationRequest(prompt, max_tokens=1, top_p=0.2)) for _ in range(64))
    )
    sampled = {r.completion_ids[0] for r in results}
    assert sampled <= nucleus and len(sampled) > 1


async def test_stop_tokens_and_strings(engine) -> None:
    prompt = _prompt(engine)
    first = await engine.generate(GenerationRequest(prompt, max_tokens=1, temperature=0))
    stopped = await engine.generate(
        GenerationRequest(
            prompt, max_tokens=5, temperature=0, stop_token_ids=[first.completion_ids[0]]
        )
    )
    assert stopped.completion_ids == first.completion_ids and stopped.finish_reason == "stop"
    text = engine.tokenizer.decode(first.completion_ids, skip_special_tokens=True)
    if text:
        by_string = await engine.generate(
            GenerationRequest(prompt, max_tokens=5, temperature=0, stop=[text])
        )
        assert by_string.finish_reason == "stop" and len(by_string.completion_ids) == 1


async def test_new_weights_apply_to_requests_after_the_load(engine, tmp_path) -> None:
    prompt = _prompt(engine)
    before = engine.score_sync([prompt])[0]
    state = {k: (v + 0.1).contiguous() for k, v in engine.model.state_dict().items()}
    save_file(state, str(tmp_path / "w.safetensors"))
    seconds = await engine.load_weights(tmp_path / "w.safetensors", version=3)
    assert seconds > 0 and engine.policy_version == 3
    after = engine.score_sync([prompt])[0]
    assert after != pytest.approx(before, abs=1e-3)
    result = await engine.generate(GenerationRequest(prompt, max_tokens=2))
    assert result.policy_version == 3


async def test_weights_that_do_not_fit_are_refused(engine, tmp_path) -> None:
    save_file({"not.a.layer": torch.zeros(3)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(EngineError, match="do not fit the model"):
        await engine.load_weights(tmp_path / "bad.safetensors", version=1)


def test_vllm_engine_explains_how_to_get_vllm(model_dir) -> None:
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401

        pytest.skip("vllm is installed here")
    except ImportError:
        pass
    with pytest.raises(EngineError, match="pip install vllm"):
        create_engine("vllm", model_dir)
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
