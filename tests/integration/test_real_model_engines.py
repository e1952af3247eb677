"""The engine contract on a real pretrained model: SmolLM2-135M-Instruct (30 layers, imported
from its GGUF), on both engines, checked like the conformance suite's random models
(tests/integration/test_engine_conformance.py) against a trainer forward pass in fp32: the
logprobs the learner's importance ratio divides by, after 30 real layers rather than 2.
Only the checks that stay fast at this size; a real model is far from uniform, so the
suite's top-p and stop checks (built for near-uniform models) stay with the random ones."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlnode.engine import GenerationRequest, create_engine, render_chat
from tests.integration.test_engine_conformance import TOLERANCE, _Reference

QUESTION = "What is 12 + 7? Answer with the number only."


@pytest.fixture(scope="module", params=["torch", "vllm"])
async def case(request, smollm2: Path):
    if request.param == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs it)")
    # vLLM eager: compiling 30 layers took ~70 s of the start here, and the compiled path is
    # the conformance suite's (its tiny-qwen2 engine); what this file checks is the numbers.
    options = (
        {"max_batch_size": 16, "max_wait_ms": 10}
        if request.param == "torch"
        else {"enforce_eager": True}
    )
    engine = create_engine(request.param, smollm2, device="cpu", dtype="float32", **options)
    yield engine, _Reference(smollm2)
    await engine.close()


def _prompt(engine, text: str = QUESTION) -> list[int]:
    return render_chat(engine.tokenizer, [{"role": "user", "content": text}])


async def test_greedy_answers_are_the_trainers_argmax_and_logprobs(case) -> None:
    engine, reference = case
    prompt = _prompt(engine)
    a = await engine.generate(GenerationRequest(prompt, max_tokens=16, temperature=0))
    b = await engine.generate(GenerationRequest(prompt, max_tokens=16, temperature=0))
    assert a.completion_ids == b.completion_ids
    expected = reference.logits(prompt + a.completion_ids)[len(prompt) - 1 : -1].argmax(-1)
    assert a.completion_ids == expected.tolist()
    assert a.logprobs == pytest.approx(
        reference.sampled_logprobs(prompt, a.completion_ids), abs=TOLERANCE
    )
    text = engine.tokenizer.decode(a.completion_ids, skip_special_tokens=True)
    assert text.strip(), "a real instruct model answers the question"


async def test_sampled_logprobs_equal_a_trainer_forward_pass(case) -> None:
    engine, reference = case
    prompt = _prompt(engine, "What is 5 + 9? Answer with the number only.")
    results = await asyncio.gather(
        *(
            engine.generate(GenerationRequest(prompt, max_tokens=16, temperature=0.7))
            for _ in range(4)
        )
    )
    for r in results:
        assert r.logprobs == pytest.approx(
            reference.sampled_logprobs(prompt, r.completion_ids, 0.7), abs=TOLERANCE
        )


async def test_new_weights_pass_the_parity_probe(case, tmp_path: Path) -> None:
    """A 538 MB weight version in the engines' fp32, as the learner publishes one."""
    engine, reference = case
    probe = _prompt(engine, "The parity probe: 0123456789 abcdefghij")
    (before,) = await engine.score([probe])
    with torch.no_grad():
        for parameter in reference.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 1e-3)
    state = {k: v.detach().clone().contiguous() for k, v in reference.model.state_dict().items()}
    del state["lm_head.weight"]  # tied, as save_pretrained writes it
    save_file(state, str(tmp_path / "v3.safetensors"))
    await engine.load_weights(tmp_path / "v3.safetensors", version=3)
    (after,) = await engine.score([probe])
    assert after != pytest.approx(before, abs=1e-3)
    assert after == pytest.approx(reference.prompt_logprobs(probe), abs=TOLERANCE)
