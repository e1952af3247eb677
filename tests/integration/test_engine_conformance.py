"""One contract, both engines: `TorchEngine` and `VLLMEngine` (vLLM's CPU build here, its CUDA
build on a GPU node), each on a Llama with the character tokenizer and on a Qwen2 with the
byte-level BPE tokenizer and ChatML.

Every logprob an engine reports is checked against a forward pass of the trainer's model
over the same tokens (fp32, within 1e-3): that is the quantity the learner's importance
ratio divides by. The engines are module-scoped (vLLM takes ~20-40 s to start on 2 cores);
the close test runs last for each.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlnode.engine import (
    BadPrompt,
    EngineError,
    GenerationRequest,
    GenerationResult,
    create_engine,
    render_chat,
)
from rlnode.models.build import init_model

TOLERANCE = 1e-3
ENGINES = ["torch", "vllm"]
MODELS = ["tiny-llama", "tiny-qwen2"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("conformance")
    return {preset: init_model(root / preset, preset, seed=0) for preset in MODELS}


@pytest.fixture(scope="module", params=[(e, m) for e in ENGINES for m in MODELS], ids="-".join)
async def case(request, models):
    kind, preset = request.param
    if kind == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs it)")
    # vLLM compiled (its default) for one model and eager for the other: both pass the same
    # checks, and an eager engine starts in about half the time.
    options = (
        {"max_batch_size": 64, "max_wait_ms": 10}
        if kind == "torch"
        else {"enforce_eager": preset == "tiny-llama"}
    )
    engine = create_engine(kind, models[preset], device="cpu", dtype="float32", **options)
    reference = _Reference(models[preset])
    yield engine, reference
    await engine.close()  # test_close closed it already unless a test before it failed


class _Reference:
    """The trainer's view of the same weights: a transformers forward pass in fp32."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def logits(self, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(input_ids=torch.tensor([ids])).logits[0].float()

    def sampled_logprobs(
        self, prompt: list[int], completion: list[int], temperature: float = 1.0, top_p: float = 1.0
    ) -> list[float]:
        """Each completion token's logprob in the distribution it was sampled from."""
        logits = self.logits(prompt + completion)[len(prompt) - 1 : -1]
        scaled = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), -1)
        if top_p < 1.0:
            scaled = torch.log_softmax(scaled.masked_fill(~_nucleus(scaled, top_p), -torch.inf), -1)
        return scaled.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        scaled = torch.log_softmax(self.logits(ids)[:-1], -1)
        return scaled.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()


def _nucleus(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest set of tokens whose probability reaches top_p, per row."""
    probs, order = logprobs.exp().sort(-1, descending=True)
    inside = probs.cumsum(-1) - probs <= top_p
    return torch.zeros_like(inside).scatter(-1, order, inside)


def _prompt(engine, text: str = "Copy: abcab") -> list[int]:
    return render_chat(engine.tokenizer, [{"role": "user", "content": text}])


async def test_greedy_is_repeatable_and_scored_like_the_trainer(case) -> None:
    engine, reference = case
    prompt = _prompt(engine)
    a = await engine.generate(GenerationRequest(prompt, max_tokens=8, temperature=0))
    b = await engine.generate(GenerationRequest(prompt, max_tokens=8, temperature=0))
    assert a.completion_ids == b.completion_ids
    expected = reference.logits(prompt + a.completion_ids)[len(prompt) - 1 : -1].argmax(-1)
    assert a.completion_ids[: len(expected)] == expected.tolist()[: len(a.completion_ids)]
    assert a.logprobs == pytest.approx(
        reference.sampled_logprobs(prompt, a.completion_ids), abs=TOLERANCE
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_sampled_logprobs_equal_a_trainer_forward_pass(case, temperature) -> None:
    engine, reference = case
    prompt = _prompt(engine, "Copy: bca")
    results = await asyncio.gather(
        *(
            engine.generate(GenerationRequest(prompt, max_tokens=12, temperature=temperature))
            for _ in range(4)
        )
    )
    for r in results:
        assert len(r.completion_ids) == len(r.logprobs) <= 12
        assert r.logprobs == pytest.approx(
            reference.sampled_logprobs(prompt, r.completion_ids, temperature), abs=TOLERANCE
        )


async def test_top_p_samples_inside_the_nucleus_and_reports_its_distribution(case) -> None:
    engine, reference = case
    prompt = _prompt(engine)
    first = torch.log_softmax(reference.logits(prompt)[-1], -1)
    nucleus = set(_nucleus(first.unsqueeze(0), 0.3)[0].nonzero().flatten().tolist())
    assert 1 < len(nucleus) < first.numel() // 2  # a real restriction on a near-uniform model
    results = await asyncio.gather(
        *(engine.generate(GenerationRequest(prompt, max_tokens=3, top_p=0.3)) for _ in range(48))
    )
    assert {r.completion_ids[0] for r in results} <= nucleus
    assert len({r.completion_ids[0] for r in results}) > 1
    for r in results[:6]:
        assert r.logprobs == pytest.approx(
            reference.sampled_logprobs(prompt, r.completion_ids, 1.0, 0.3), abs=TOLERANCE
        )


async def test_stop_tokens_and_stop_strings_end_the_completion(case) -> None:
    engine, reference = case
    prompt = _prompt(engine)
    # Random models are near-uniform over their vocabulary: stop at a set of tokens (the most
    # likely tenth at the first position) and at a few letters, so that some samples stop.
    first = torch.log_softmax(reference.logits(prompt)[-1], -1)
    stop_tokens = [
        t
        for t in first.argsort(descending=True)[: first.numel() // 10].tolist()
        if t != _eos(engine)
    ]
    results = await asyncio.gather(
        *(
            engine.generate(GenerationRequest(prompt, max_tokens=8, stop_token_ids=stop_tokens))
            for _ in range(24)
        )
    )
    for r in results:
        # The stop token is part of the completion (it was sampled; the learner trains on it).
        assert not set(r.completion_ids[:-1]) & set(stop_tokens)
        ended = r.completion_ids[-1] in stop_tokens or r.completion_ids[-1] == _eos(engine)
        assert (r.finish_reason == "stop") == ended
    assert any(r.completion_ids[-1] in stop_tokens for r in results)

    stops = ["e", "a", "o", "i", "t", "s"]
    results = await asyncio.gather(
        *(engine.generate(GenerationRequest(prompt, max_tokens=8, stop=stops)) for _ in range(24))
    )
    stopped = 0
    for r in results:
        text = engine.tokenizer.decode(r.completion_ids, skip_special_tokens=True)
        before = engine.tokenizer.decode(r.completion_ids[:-1], skip_special_tokens=True)
        assert not any(s in before for s in stops)  # it ends at the token that completed one
        if any(s in text for s in stops):
            assert r.finish_reason == "stop"
            stopped += 1
    assert stopped > 0


def _eos(engine) -> int:
    return engine.tokenizer.eos_token_id


async def test_many_concurrent_requests_each_get_their_own_answer(case) -> None:
    engine, reference = case
    prompts = [_prompt(engine, f"Copy: {'abc'[i % 3] * (i % 5 + 1)}") for i in range(48)]
    results = await asyncio.gather(
        *(
            engine.generate(GenerationRequest(p, max_tokens=5 + i % 4))
            for i, p in enumerate(prompts)
        )
    )
    for i, r in enumerate(results):
        assert 1 <= len(r.completion_ids) <= 5 + i % 4
    for prompt, r in list(zip(prompts, results, strict=True))[::8]:
        assert r.logprobs == pytest.approx(
            reference.sampled_logprobs(prompt, r.completion_ids), abs=TOLERANCE
        )


async def test_a_prompt_the_model_cannot_embed_fails_alone(case) -> None:
    engine, _reference = case
    good = _prompt(engine)
    outcomes = await asyncio.gather(
        *(engine.generate(GenerationRequest(good, max_tokens=4)) for _ in range(3)),
        engine.generate(GenerationRequest([*good, engine.vocab_size], max_tokens=4)),
        engine.generate(GenerationRequest([-1, *good], max_tokens=4)),
        return_exceptions=True,
    )
    assert all(isinstance(o, GenerationResult) for o in outcomes[:3]), outcomes[:3]
    for refused in outcomes[3:]:
        assert isinstance(refused, BadPrompt), refused
        assert "outside this model's vocabulary" in str(refused)
    with pytest.raises(BadPrompt):
        await engine.score([[*good, engine.vocab_size + 7]])


async def test_score_gives_prompt_logprobs(case) -> None:
    engine, reference = case
    sequences = [[*_prompt(engine, "Copy: abc"), 5, 6, 7], _prompt(engine, "hello")]
    scored = await engine.score(sequences)
    for sequence, logprobs in zip(sequences, scored, strict=True):
        assert len(logprobs) == len(sequence) - 1
        assert logprobs == pytest.approx(reference.prompt_logprobs(sequence), abs=TOLERANCE)


async def test_new_weights_between_requests_pass_the_parity_probe(case, tmp_path) -> None:
    engine, reference = case
    probe = _prompt(engine, "The parity probe: 0123456789")
    before = await engine.score([probe])
    with torch.no_grad():
        for parameter in reference.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    state = {k: v.detach().clone().contiguous() for k, v in reference.model.state_dict().items()}
    if reference.model.config.tie_word_embeddings:  # as save_pretrained writes a tied model
        del state["lm_head.weight"]
    save_file(state, str(tmp_path / "v7.safetensors"))
    seconds = await engine.load_weights(tmp_path / "v7.safetensors", version=7)
    assert seconds > 0 and engine.policy_version == 7
    (after,) = await engine.score([probe])
    assert after != pytest.approx(before[0], abs=1e-2)  # the weights did change
    assert after == pytest.approx(reference.prompt_logprobs(probe), abs=TOLERANCE)
    result = await engine.generate(GenerationRequest(_prompt(engine), max_tokens=4))
    assert result.policy_version == 7
    assert result.logprobs == pytest.approx(
        reference.sampled_logprobs(_prompt(engine), result.completion_ids), abs=TOLERANCE
    )


async def test_weights_that_do_not_fit_are_refused_and_the_engine_goes_on(case, tmp_path) -> None:
    engine, _ = case
    save_file({"not.a.layer": torch.zeros(3)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(EngineError, match="do not fit the model"):
        await engine.load_weights(tmp_path / "bad.safetensors", version=8)
    assert engine.policy_version == 7
    result = await engine.generate(GenerationRequest(_prompt(engine), max_tokens=2))
    assert result.policy_version == 7


async def test_new_weights_while_requests_run_each_token_carries_its_own_weights(
    case, tmp_path
) -> None:
    """Weights loaded while requests generate: every token's logprob is that of the weights
    it was sampled under (what the learner's importance ratio divides by), old ones then new
    ones, and a result names both versions when it spans the swap. vLLM swaps in flight
    (swap="keep": the requests stop, the weights change, they go on); the torch engine
    finishes its batch on the old weights first."""
    import copy

    engine, reference = case
    old = _Reference.__new__(_Reference)
    old.model = copy.deepcopy(reference.model)
    version = engine.policy_version
    with torch.no_grad():
        for parameter in reference.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    state = {k: v.detach().clone().contiguous() for k, v in reference.model.state_dict().items()}
    if reference.model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    save_file(state, str(tmp_path / "v9.safetensors"))
    prompt = _prompt(engine, "Keep going: abcabcabc")
    request = GenerationRequest(prompt, max_tokens=96, temperature=1.0)
    running = [asyncio.ensure_future(engine.generate(request)) for _ in range(16)]
    await asyncio.sleep(0.05)
    await engine.load_weights(tmp_path / "v9.safetensors", version=9)
    results: list[GenerationResult] = await asyncio.gather(*running)
    spanned = 0
    for result in results:
        ids = result.completion_ids
        under_old = old.sampled_logprobs(prompt, ids)
        under_new = reference.sampled_logprobs(prompt, ids)
        switch = next(
            (
                i
                for i, (lp, o) in enumerate(zip(result.logprobs, under_old, strict=True))
                if abs(lp - o) > TOLERANCE
            ),
            len(ids),
        )
        assert result.logprobs[switch:] == pytest.approx(under_new[switch:], abs=TOLERANCE)
        if 0 < switch < len(ids):
            spanned += 1
            assert (result.policy_version, result.last_policy_version) == (version, 9)
        elif switch == len(ids) and ids:
            assert result.policy_version == version
    if getattr(engine, "swap", None) == "keep":
        assert spanned, "no request was in flight across the swap"
    else:
        assert spanned == 0


async def test_close_ends_the_engine_and_later_requests_fail_clearly(case) -> None:
    engine, _ = case
    await engine.close()
    with pytest.raises(EngineError, match="closed"):
        await engine.generate(GenerationRequest(_prompt(engine), max_tokens=2))


def test_vllm_on_the_cpu_refuses_a_head_size_it_cannot_run(tmp_path) -> None:
    """vLLM's CPU attention fails at the first request, not at start-up, on head sizes it
    lacks (the demo's tiny model has 16): the engine says so before starting vLLM."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs it)")
    tiny = init_model(tmp_path / "tiny", "tiny", seed=0)
    with pytest.raises(EngineError, match=r"head size is 16 .*GENERATOR_ENGINE=torch"):
        create_engine("vllm", tiny, device="cpu")
