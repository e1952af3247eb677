"""The in-process limit: the same engine, the same GRPO code and the same trainer the services
use, called directly in one process with the copy task's reward computed in-process: no
Kafka, no HTTP, no Task App process. Benchmarks compare the services against it (B3), and
it is the quickest way to try hyperparameters on the tiny model.

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
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from bench_common import training_arguments

from rlnode.engine import GenerationRequest, render_chat
from rlnode.engine.torch_engine import TorchEngine
from rlnode.examples.taskapps import copy_task as COPY
from rlnode.messages import TokenTurn, Trajectory
from rlnode.models.tiny import init_tiny_model
from rlnode.training.grpo import group_advantages, samples_from
from rlnode.training.trainer import Trainer, TrainerConfig


@dataclass
class LoopConfig:
    steps: int = 60
    prompts_per_step: int = 8
    group_size: int = 8
    learning_rate: float = 5e-3
    max_tokens: int = 6
    temperature: float = 1.0
    max_async: int = 0
    minibatches: int = 1
    env_config: dict = field(default_factory=lambda: {"length": 3, "alphabet": "abc"})
    seed: int = 0

    @classmethod
    def from_arguments(cls, args, **changes) -> LoopConfig:
        """From bench_common.training_arguments' options."""
        return cls(
            steps=args.steps,
            prompts_per_step=args.prompts,
            group_size=args.group,
            learning_rate=args.lr,
            minibatches=args.minibatches,
            max_async=args.max_async,
            **changes,
        )


@dataclass
class StepRecord:
    step: int
    reward_mean: float
    samples: int
    elapsed_s: float  # since the loop started, when this step's update finished


async def _rollout(engine: TorchEngine, cfg: LoopConfig, step: int, seed: int, sample: int):
    task = COPY.make_task(seed, cfg.env_config)
    prompt_ids = render_chat(engine.tokenizer, COPY.prompt(task))
    result = await engine.generate(
        GenerationRequest(prompt_ids, max_tokens=cfg.max_tokens, temperature=cfg.temperature)
    )
    answer = engine.tokenizer.decode(result.completion_ids, skip_special_tokens=True)
    return Trajectory(
        job_id="inprocess",
        org_id="bench",
        work_id=uuid.uuid4(),
        rollout_id=f"{step}-{seed}-{sample}",
        generator="inprocess",
        step=step,
        group_id=f"{step}/{seed}",
        seed=seed,
        sample_index=sample,
        status="ok",
        reward=COPY.reward(task, answer),
        turns=[
            TokenTurn(
                prompt_ids=prompt_ids,
                completion_ids=result.completion_ids,
                logprobs=result.logprobs,
                policy_version=result.policy_version,
                finish_reason=result.finish_reason,
            )
        ],
    )


async def _batch(engine: TorchEngine, cfg: LoopConfig, step: int) -> list[Trajectory]:
    seeds = [step * cfg.prompts_per_step + p for p in range(cfg.prompts_per_step)]
    return list(
        await asyncio.gather(
            *(_rollout(engine, cfg, step, s, i) for s in seeds for i in range(cfg.group_size))
        )
    )


async def run_loop(model: Path, cfg: LoopConfig, weights_dir: Path) -> list[StepRecord]:
    """Train for cfg.steps; batches for up to cfg.max_async steps ahead are sampled while
    the trainer works, and new weights go to the engine after every step (as a file, the
    way the services hand them over)."""
    engine = TorchEngine(model, dtype="float32", max_batch_size=256, max_wait_ms=2, seed=cfg.seed)
    trainer = Trainer(
        model,
        TrainerConfig(
            learning_rate=cfg.learning_rate,
            temperature=cfg.temperature,
            minibatches=cfg.minibatches,
            seed=cfg.seed,
        ),
    )
    records: list[StepRecord] = []
    started = time.perf_counter()
    pending = {
        s: asyncio.create_task(_batch(engine, cfg, s))
        for s in range(min(cfg.max_async + 1, cfg.steps))
    }
    try:
        for step in range(cfg.steps):
            trajectories = await pending.pop(step)
            samples = [
                s
                for s in samples_from(trajectories, group_advantages(trajectories))
                if s.advantage != 0.0
            ]
            if samples:
                await asyncio.to_thread(trainer.step, samples)
            path = weights_dir / f"v{step + 1}.safetensors"
            await asyncio.to_thread(trainer.save_weights, path)
            await engine.load_weights(path, step + 1)
            path.unlink()
            if step + cfg.max_async + 1 < cfg.steps:
                nxt = step + cfg.max_async + 1
                pending[nxt] = asyncio.create_task(_batch(engine, cfg, nxt))
            records.append(
                StepRecord(
                    step=step + 1,
                    reward_mean=statistics.fmean(t.reward for t in trajectories),
                    samples=len(trajectories),
                    elapsed_s=time.perf_counter() - started,
                )
            )
    finally:
        for task in pending.values():
            task.cancel()
        await engine.close()
    return records


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
        cfg = LoopConfig.from_arguments(
            args, seed=seed, env_config={"length": args.length, "alphabet": args.alphabet}
        )
        with tempfile.TemporaryDirectory() as tmp:
            model = init_tiny_model(Path(tmp) / "m", seed=0, hidden=args.hidden, layers=args.layers)
            records = asyncio.run(run_loop(model, cfg, Path(tmp)))
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
