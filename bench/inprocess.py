"""The in-process limit: the learner's own job loop (`JobRunner`, with its max_async
scheduling, GRPO step, weight versions and checkpoints) on the in-memory transport, with an
`InProcessGenerator` playing the copy task's Task App code against the same torch engine
the generators use: no Kafka, no HTTP, no Task App process. Benchmarks compare the services
against it (B3), and it is the quickest way to try hyperparameters on the tiny model.

    python bench/inprocess.py --steps 60 --prompts 8 --group 8 --lr 5e-3 [--max-async 1]
    python bench/inprocess.py --steps 100 --group 16 --lr 3e-3 --minibatches 2 --max-async 1 \
        --seeds 0-15        # a seed sweep: median gain and how many runs reach +0.4
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench_common import job_config, training_arguments

from rlnode.engine.torch_engine import TorchEngine
from rlnode.examples.taskapps import copy_task
from rlnode.messages import JobConfig, JobEventType
from rlnode.models.build import init_tiny_model
from rlnode.training.inprocess import InProcessGenerator
from rlnode.training.loop import JobRunner
from rlnode.training.transport import InMemoryTransport


@dataclass
class StepRecord:
    step: int
    reward_mean: float
    samples: int
    elapsed_s: float  # since the loop started, when this step's update finished


async def run_loop(model: Path, config: JobConfig, root: Path) -> list[StepRecord]:
    """Train as `config` says; one record per training step."""
    transport = InMemoryTransport()
    runner = JobRunner("inprocess", "bench", config, transport, root, ["cpu"], 600.0)
    engine = TorchEngine(
        model, dtype="float32", max_batch_size=256, max_wait_ms=2, seed=config.training.seed
    )
    generator = InProcessGenerator(engine, copy_task.DEFINITION, runner.offer).attach(transport)
    try:
        await runner.run()
    finally:
        await generator.close()
        await engine.close()
    started = next(e.ts for e in transport.events if e.type is JobEventType.STARTED)
    per_step = config.training.prompts_per_step * config.training.group_size
    return [
        StepRecord(
            step=e.data["step"],
            reward_mean=e.data["reward_mean"],
            samples=per_step,
            elapsed_s=(e.ts - started).total_seconds(),
        )
        for e in transport.events
        if e.type is JobEventType.TRAIN_STEP
    ]


def loop_config(model: Path, args, seed: int = 0, env_config: dict | None = None) -> JobConfig:
    """The services' copy-task job for these arguments (bench_common.job_config), with the
    training seed and, if given, another copy task."""
    config = job_config(model, args)
    config = config.model_copy(
        update={"training": config.training.model_copy(update={"seed": seed})}
    )
    if env_config is not None:
        task_app = config.task_app.model_copy(update={"env_config": env_config})
        config = config.model_copy(update={"task_app": task_app})
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    training_arguments(parser, steps=60, max_async=0)
    parser.add_argument(
        "--seeds", default="0", help="sampling/training seeds: 3, 0-7 or 1,4,9; several: a sweep"
    )
    parser.add_argument("--hidden", type=int, default=64, help="tiny model width")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--length", type=int, default=3, help="copy-task string length")
    parser.add_argument("--alphabet", default="abc")
    args = parser.parse_args()
    gains = []
    for seed in _seeds(args.seeds):
        with tempfile.TemporaryDirectory() as tmp:
            model = init_tiny_model(Path(tmp) / "m", seed=0, hidden=args.hidden, layers=args.layers)
            env_config = {"length": args.length, "alphabet": args.alphabet}
            config = loop_config(model, args, seed, env_config)
            records = asyncio.run(run_loop(model, config, Path(tmp)))
        rewards = [r.reward_mean for r in records]
        head, tail = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
        gains.append(tail - head)
        total = records[-1].elapsed_s
        print(f"seed {seed}: " + " ".join(f"{r:.2f}" for r in rewards))
        print(
            f"seed {seed}: first5 {head:.3f} last5 {tail:.3f} gain {tail - head:+.3f} | "
            f"{total:.1f}s, {sum(r.samples for r in records) / total:.1f} samples/s",
            file=sys.stderr,
        )
    if len(gains) > 1:
        print(
            f"{len(gains)} seeds: median gain {statistics.median(gains):+.3f}, "
            f"min {min(gains):+.3f}, {sum(g >= 0.4 for g in gains)} of {len(gains)} at +0.4 or more",
            file=sys.stderr,
        )


def _seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        seeds.extend(range(int(first), int(last or first) + 1))
    return seeds


if __name__ == "__main__":
    main()
