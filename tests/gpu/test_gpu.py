"""Checks that need CUDA: run by `make test-gpu` on a GPU node (skipped elsewhere, like every
`gpu`-marked test). What they cover is what the CPU suite cannot: vLLM's CUDA build against
a trainer forward pass, the trainer's bf16 compute, weights published in bf16 going into
vLLM with the parity probe, and FSDP2 over two GPUs with NCCL.

Not here yet: NCCL weight transfer into vLLM (its weight-transfer API); the file path is
what the node uses today."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rlnode.engine import GenerationRequest, create_engine, render_chat
from rlnode.messages import TrainingSpec
from rlnode.messages.config import AdamWSpec
from rlnode.models.build import init_model
from rlnode.training.grpo import Sample
from rlnode.training.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("gpu") / "qwen", "tiny-qwen2", seed=0)


def _forward(model_dir: Path, ids: list[int], start: int, dtype: torch.dtype) -> list[float]:
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
    with torch.inference_mode():
        logits = lm(input_ids=torch.tensor([ids], device="cuda")).logits[0].float()
    scaled = torch.log_softmax(logits[start - 1 : -1], -1)
    return scaled.gather(-1, torch.tensor(ids[start:], device="cuda")[:, None])[:, 0].tolist()


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-3), ("bfloat16", 5e-2)])
async def test_vllm_cuda_logprobs_equal_a_forward_pass(model, dtype, tolerance) -> None:
    pytest.importorskip("vllm")
    engine = create_engine("vllm", model, device="cuda", dtype=dtype, gpu_memory_utilization=0.3)
    try:
        prompt = render_chat(engine.tokenizer, [{"role": "user", "content": "Copy: abcab"}])
        results = await asyncio.gather(
            *(engine.generate(GenerationRequest(prompt, max_tokens=16)) for _ in range(32))
        )
        for r in results[:4]:
            expected = _forward(
                model, prompt + r.completion_ids, len(prompt), getattr(torch, dtype)
            )
            assert r.logprobs == pytest.approx(expected, abs=tolerance)
    finally:
        await engine.close()


async def test_bf16_weights_from_the_trainer_pass_the_probe_in_vllm(model, tmp_path) -> None:
    pytest.importorskip("vllm")
    trainer = Trainer(
        model, TrainerConfig.of(TrainingSpec(optimizer=AdamWSpec(lr=1e-3))), device="cuda"
    )
    tokenizer = trainer.tokenizer
    prompt = list(tokenizer("Copy: abc")["input_ids"])
    completion = [*tokenizer("abc")["input_ids"], tokenizer.eos_token_id]
    samples = [
        Sample(prompt, completion, [-8.0] * len(completion), 1.0 - 2 * (i % 2)) for i in range(8)
    ]
    trainer.step(samples)
    digest, _size = trainer.save_weights(tmp_path / "v1.safetensors", "bfloat16")
    engine = create_engine(
        "vllm", model, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3
    )
    try:
        await engine.load_weights(tmp_path / "v1.safetensors", 1, digest)
        probe = list(tokenizer("The parity probe: 0123456789")["input_ids"])
        (scored,) = await engine.score([probe])
        assert scored == pytest.approx(trainer.score(probe), abs=5e-2)
    finally:
        await engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_over_two_gpus_matches_one(model, tmp_path) -> None:
    from safetensors.torch import load_file

    from rlnode.training.distributed import DataParallelTrainer

    config = TrainerConfig.of(TrainingSpec(optimizer=AdamWSpec(lr=1e-3)))
    single = Trainer(model, config, device="cuda:0")
    tokenizer = single.tokenizer
    prompt = list(tokenizer("Copy: abc")["input_ids"])
    samples = [
        Sample(prompt, list(tokenizer("abc")["input_ids"]), [-8.0] * 2, 1.0 - 2 * (i % 2))
        for i in range(8)
    ]
    single.step(samples)
    single.save_weights(tmp_path / "single.safetensors")
    parallel = DataParallelTrainer(model, config, ["cuda:0", "cuda:1"])
    try:
        parallel.step(samples)
        parallel.save_weights(tmp_path / "parallel.safetensors")
    finally:
        parallel.close()
    expected = load_file(str(tmp_path / "single.safetensors"))
    for name, tensor in load_file(str(tmp_path / "parallel.safetensors")).items():
        assert torch.allclose(tensor, expected[name], atol=2e-2), name  # bf16 compute
