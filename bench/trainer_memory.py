"""B5 — trainer memory: what one training step holds per rank, for the Qwen2.5-0.5B-shaped
model (random weights, `rlnode model init --preset qwen2.5-0.5b`) on the CPU, with 1 and 2
ranks (gloo), against the trainer before #14 (DDP replicas, full-vocabulary log-softmax over
every position), taken from git at BASELINE_COMMIT and run in the same invocation.

Per rank and configuration, each in fresh processes:
- bytes per parameter held for weights + gradients + optimizer state (the local shards of
  those tensors, counted after the step);
- peak RSS during one step (VmHWM, reset just before the step) and the step's seconds;
and the output layer alone at the same micro-batch: the peak RSS of today's logits path
(log-softmax over [rows, positions, vocab]) against the chunked one, forward + backward to
the hidden states.

    python bench/trainer_memory.py [--rows 4] [--prompt 64] [--completion 192]

Writes bench/results/trainer_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_common import own_status_bytes, reset_own_peak, write_results

BASELINE_COMMIT = "abec226"  # the last commit with the DDP trainer


def _baseline_trainer_module(root: Path) -> Any:
    """The trainer module as it was at BASELINE_COMMIT (it hashed weights with a helper that
    has since gone; nothing this benchmark calls uses it)."""
    source = subprocess.run(
        ["git", "show", f"{BASELINE_COMMIT}:libs/rlnode/training/trainer.py"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent,
    ).stdout
    source = source.replace("from rlnode.messages.weights import sha256_of\n", "sha256_of = None\n")
    path = root / "baseline_trainer.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_trainer", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def _samples(tokenizer_size: int, rows: int, prompt: int, completion: int, seed: int):
    import random

    from rlnode.training.grpo import Sample

    rng = random.Random(seed)
    return [
        Sample(
            prompt_ids=[rng.randrange(tokenizer_size) for _ in range(prompt)],
            completion_ids=[rng.randrange(tokenizer_size) for _ in range(completion)],
            behaviour_logprobs=[-8.0] * completion,
            advantage=1.0 if i % 2 else -1.0,
        )
        for i in range(rows)
    ]


def _held_bytes(parameters: list, optimizer: Any) -> int:
    def local(t: Any) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    return (
        sum(local(p) for p in parameters)
        + sum(local(p.grad) for p in parameters if p.grad is not None)
        + sum(
            local(v)
            for state in optimizer.state.values()
            for v in state.values()
            if hasattr(v, "dim") and v.dim() > 0
        )
    )


def rank_main(rank: int, world: int, port: int, which: str, args: dict, out: str) -> None:
    import torch
    import torch.distributed as dist

    from rlnode.messages import TrainingSpec

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    with tempfile.TemporaryDirectory() as tmp:
        module = (
            _baseline_trainer_module(Path(tmp))
            if which == "baseline"
            else importlib.import_module("rlnode.training.trainer")
        )
        spec = TrainingSpec(
            tokens_per_micro_batch=args["rows"] * (args["prompt"] + args["completion"])
        )
        trainer = module.Trainer(args["model"], module.TrainerConfig.of(spec))
        samples = _samples(
            len(trainer.tokenizer), args["rows"] * world, args["prompt"], args["completion"], 0
        )
        before = own_status_bytes("VmRSS")
        reset_own_peak()
        started = time.perf_counter()
        trainer.step(samples)
        seconds = time.perf_counter() - started
        peak = own_status_bytes("VmHWM")
        parameters = list(trainer.model.parameters())
        total = sum(p.numel() for p in parameters)  # a DTensor's numel is the whole tensor's
        held = _held_bytes(parameters, trainer.optimizer)
        result = {
            "rank": rank,
            "parameters": total,
            "held_bytes_per_parameter": held / total,
            "rss_before_step_gb": before / 1e9,
            "peak_rss_in_step_gb": peak / 1e9,
            "step_s": seconds,
        }
        Path(f"{out}.rank{rank}").write_text(json.dumps(result))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def head_main(mode: str, args: dict, out: str) -> None:
    """The output layer alone: hidden states [rows, positions, hidden] -> logprobs of the
    completion tokens -> backward, today's way (every position, full log-softmax) or chunked."""
    import torch

    from rlnode.models.build import shape_of
    from rlnode.training.trainer import token_logprobs

    shape = shape_of(args["preset"])
    rows, length = args["rows"], args["prompt"] + args["completion"]
    torch.manual_seed(0)
    hidden = torch.randn(rows, length, shape.hidden, requires_grad=True)
    vocab = shape.vocab or 4096  # the BPE tokenizer's size when the preset leaves it open
    # Frozen here: the output layer's weight gradient is a parameter gradient, counted with
    # the trainer's state above; this measures what is shaped like the logits.
    weight = torch.randn(vocab, shape.hidden) * 0.02
    targets = torch.randint(0, vocab, (rows, length))

    def run(hidden, weight, targets) -> None:
        if mode == "full":
            logits = (hidden @ weight.t()).float()
            scaled = torch.log_softmax(logits[:, :-1], dim=-1)
            chosen = scaled.gather(-1, targets[:, 1:].unsqueeze(-1)).squeeze(-1)
            loss = chosen[:, args["prompt"] - 1 :].sum()
        else:
            positions = hidden[:, args["prompt"] - 1 : -1].reshape(-1, hidden.shape[-1])
            loss = token_logprobs(
                positions, weight, targets[:, args["prompt"] :].reshape(-1), 1.0, args["chunk"]
            ).sum()
        loss.backward()

    # Once on a sliver first: the first backward allocates autograd's own state.
    run(hidden[:1].detach().requires_grad_(), weight[:64], targets[:1] % 64)
    before = own_status_bytes("VmRSS")
    reset_own_peak()
    run(hidden, weight, targets)
    peak = own_status_bytes("VmHWM")
    Path(out).write_text(json.dumps({"mode": mode, "peak_over_inputs_gb": (peak - before) / 1e9}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run_trainer(which: str, world: int, args: dict, estimate_bytes: float) -> dict:
    if _available_bytes() < estimate_bytes:
        return {
            "skipped": f"needs about {estimate_bytes / 1e9:.0f} GB, "
            f"{_available_bytes() / 1e9:.0f} GB available"
        }
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result")
        port = _free_port()
        children = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank-of",
                    json.dumps([r, world, port, which, args, out]),
                ]
            )
            for r in range(world)
        ]
        codes = [c.wait() for c in children]
        if any(codes):
            return {"failed": f"exit codes {codes}"}
        ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]
    return {
        "held_bytes_per_parameter": max(r["held_bytes_per_parameter"] for r in ranks),
        "peak_rss_in_step_gb": max(r["peak_rss_in_step_gb"] for r in ranks),
        "rss_before_step_gb": max(r["rss_before_step_gb"] for r in ranks),
        "step_s": max(r["step_s"] for r in ranks),
        "parameters": ranks[0]["parameters"],
    }


def run_head(mode: str, args: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "head")
        subprocess.run(
            [sys.executable, __file__, "--head-of", json.dumps([mode, args, out])], check=True
        )
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=4, help="sequences per micro-batch per rank")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--completion", type=int, default=192, help="completion tokens")
    parser.add_argument("--chunk", type=int, default=64, help="logit_chunk_tokens")
    parser.add_argument("--preset", default="qwen2.5-0.5b", help="rlnode model init preset")
    args = parser.parse_args()
    from rlnode.models.build import init_model, shape_of

    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(Path(tmp) / "m", args.preset, seed=0)
        config = {**vars(args), "model": str(model)}
        parameters = json.loads((model / "rlnode-model.json").read_text())["parameters"]
        results: dict[str, Any] = {"head": {}, "trainer": {}}
        for mode in ("full", "chunked"):
            results["head"][mode] = run_head(mode, config)
            print(mode, results["head"][mode], flush=True)
        margin = 3e9  # activations, the gathered layer, the process itself
        for which, world, per_parameter in (
            ("baseline", 1, 16),
            ("fsdp", 1, 16),
            ("fsdp", 2, 8),
            ("baseline", 2, 20),  # a full replica per rank, plus DDP's gradient buckets
        ):
            key = f"{which}-{world}"
            results["trainer"][key] = run_trainer(
                which, world, config, world * (per_parameter * parameters + margin)
            )
            print(key, results["trainer"][key], flush=True)
    vocab = shape_of(args.preset).vocab or 4096  # the BPE tokenizer's size when unset
    head = results["head"]
    ratio = head["chunked"]["peak_over_inputs_gb"] / head["full"]["peak_over_inputs_gb"]
    names = {
        "baseline-1": "before #14, 1 rank",
        "fsdp-1": "now, 1 rank",
        "fsdp-2": "now, 2 ranks (FSDP2)",
        "baseline-2": "before #14, 2 ranks (DDP)",
    }
    table = [
        f"Model: {args.preset} shape ({parameters:,} parameters, vocab {vocab:,}), random weights, "
        f"fp32 master weights on the CPU. Micro-batch per rank: {args.rows} sequences of "
        f"{args.prompt} prompt + {args.completion} completion tokens; one training step.",
        "",
        "| trainer | weights + grads + optimizer, bytes/param/rank | peak RSS in the step, GB/rank | step s |",
        "|---|---|---|---|",
    ]
    for key, name in names.items():
        r = results["trainer"][key]
        if "skipped" in r or "failed" in r:
            table.append(f"| {name} | {r.get('skipped') or r.get('failed')} | | |")
            continue
        table.append(
            f"| {name} | {r['held_bytes_per_parameter']:.1f} | {r['peak_rss_in_step_gb']:.1f} | "
            f"{r['step_s']:.0f} |"
        )
    table += [
        "",
        "| output layer (forward + backward) | peak over its inputs, GB |",
        "|---|---|",
        f"| before #14: log-softmax over every position | {head['full']['peak_over_inputs_gb']:.2f} |",
        f"| now: completion tokens, {args.chunk} at a time | {head['chunked']['peak_over_inputs_gb']:.2f} |",
        "",
        f"Logits peak now / before: **{ratio:.3f}** (goal <= 0.125). Weights + gradients + "
        "optimizer per rank at 2 ranks: **"
        + (
            f"{results['trainer']['fsdp-2']['held_bytes_per_parameter']:.1f}"
            if "held_bytes_per_parameter" in results["trainer"]["fsdp-2"]
            else "?"
        )
        + " bytes/parameter** (goal <= 10).",
    ]
    write_results(
        "trainer_memory",
        args,
        f"B5 — trainer memory per rank ({args.preset} shape, CPU)",
        table,
        **results,
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-of":
        rank_main(*json.loads(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--head-of":
        head_main(*json.loads(sys.argv[2]))
    else:
        main()
