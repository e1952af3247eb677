"""Multi-turn episodes trained as one sequence against one sample per turn: the trainer's
time per training step, and the tokens it runs, on the same guess-a-number trajectories.

Each episode's turns are played by the guess-number Task App's own code against the torch
engine, recorded turn by turn as the generator records them (`InProcessGenerator`: the
model's chat template renders the history for every call). Every prompt holds the whole
conversation so far, so a sample per turn runs the history once per turn; merged
(`rlnode.training.grpo.merge_turns`), an episode is one row, the environment's tokens
masked out. Episodes whose turns do not extend each other token for token stay a sample
per turn in both variants. The advantages are set, not learnt (+1/-1 alternately: a random
model never finds the number, and a tied group trains nothing); the two variants' steps run
interleaved, in alternating order, on one trainer, after one warm-up step each.

    python bench/multi_turn.py [--models tiny,smollm2] [--episodes 8] [--max-turns 8] \
        [--max-tokens 8] [--repeats 3]

`tiny`: the tests' tiny model (character tokenizer, random weights): it samples its
tokenizer's special tokens, which the reply's text drops, so few of its episodes' turns
extend each other: mostly the fallback, a control. `smollm2`: SmolLM2-135M-Instruct,
imported from the GGUF its package ships (make setup installs it; ~20 s), a real chat model
with a byte-level BPE: the figure that counts. About 6 minutes on 2 cores, most of it
SmolLM2's per-turn steps. Writes bench/results/multi_turn.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import write_results

from rlnode.engine.torch_engine import TorchEngine
from rlnode.examples import example_job
from rlnode.examples.taskapps import guess_number
from rlnode.messages import RolloutWork, TrainingSpec, Trajectory
from rlnode.messages.config import AdamWSpec
from rlnode.models.build import init_model
from rlnode.training.grpo import Sample, merge_turns, sample_batch, trained_tokens
from rlnode.training.inprocess import InProcessGenerator
from rlnode.training.trainer import Trainer, TrainerConfig, completion_logprobs, micro_batches

# The micro-batch budget per model: the job default for the tiny one; for SmolLM2 the
# fastest measured in B9 (bench/README.md).
MICRO_BATCH_TOKENS = {"tiny": 8192, "smollm2": 1024}


def model_dir(name: str, workdir: Path) -> Path:
    if name == "tiny":
        # init_tiny_model's model with room for 8 turns of the character tokenizer's prompts.
        return init_model(workdir / "tiny", "tiny", seed=0, max_positions=2048)
    if name == "smollm2":
        from rlnode.models.catalogue import packaged_gguf
        from rlnode.models.gguf import import_gguf

        return import_gguf(packaged_gguf("smollm2-135m-instruct"), workdir / "models").path
    raise SystemExit(f"unknown model {name!r}: tiny or smollm2")


async def episodes(model: Path, args) -> tuple[list[Trajectory], float]:
    """`args.episodes` guess-number episodes (groups of 8 over seeds), and the seconds."""
    config = example_job("copy_task", model)
    task_app = config.task_app.model_copy(
        update={"env_config": {"high": 100, "max_turns": args.max_turns}}
    )
    sampling = config.sampling.model_copy(update={"max_tokens": args.max_tokens})
    engine = TorchEngine(model, dtype="float32", max_batch_size=256, max_wait_ms=2, seed=0)
    generator = InProcessGenerator(engine, guess_number.DEFINITION, lambda _t: None)
    group = min(8, args.episodes)
    calls = []
    for first in range(0, args.episodes, group):
        count = min(group, args.episodes - first)
        work = RolloutWork(
            job_id="bench",
            org_id="bench",
            step=0,
            policy_version=0,
            group_id=f"0/{first}",
            seed=first,
            sample_index=0,
            samples=count,
            group_size=count,
            model=config.model,
            task_app=task_app,
            sampling=sampling,
        )
        calls += [generator.rollout(work, i) for i in work.sample_indices]
    started = time.perf_counter()
    try:
        trajectories = list(await asyncio.gather(*calls))
    finally:
        await engine.close()
    return [t for t in trajectories if t.status == "ok"], time.perf_counter() - started


def shape(samples: list[Sample], budget: int) -> dict[str, int]:
    batches = micro_batches(samples, budget)
    return {
        "samples": len(samples),
        "row_tokens": sum(s.tokens for s in samples),
        "padded_tokens": sum(len(b) * b[0].tokens for b in batches),
        "trained_tokens": sum(trained_tokens(s) for s in samples),
        "micro_batches": len(batches),
    }


def logprob_agreement(trainer: Trainer, trajectories: list[Trajectory]) -> float:
    """Max |difference| of the trainer's logprobs of the model's tokens, merged vs per turn."""
    worst = 0.0
    with torch.no_grad():
        for t in trajectories:
            merged = merge_turns(t, 1.0)
            if not merged or len(t.turns) < 2:
                continue
            per_turn = sample_batch([t], {str(t.id): 1.0}, merge=False).samples
            one, one_mask = completion_logprobs(trainer.policy, merged, "cpu", 1.0, trainer.pad_id)
            rows, rows_mask = completion_logprobs(
                trainer.policy, per_turn, "cpu", 1.0, trainer.pad_id
            )
            a, b = one[one_mask.bool()], rows[rows_mask.bool()]
            worst = max(worst, float((a - b).abs().max()))
    return worst


def measure(name: str, args, workdir: Path) -> dict[str, Any]:
    model = model_dir(name, workdir)
    trajectories, generation_s = asyncio.run(episodes(model, args))
    advantages = {str(t.id): 1.0 if i % 2 else -1.0 for i, t in enumerate(trajectories)}
    variants = {
        "per turn": sample_batch(trajectories, advantages, merge=False),
        "one sequence": sample_batch(trajectories, advantages),
    }
    budget = MICRO_BATCH_TOKENS[name]
    trainer = Trainer(
        model,
        TrainerConfig.of(TrainingSpec(optimizer=AdamWSpec(lr=1e-6), tokens_per_micro_batch=budget)),
    )
    agreement = logprob_agreement(trainer, trajectories)
    for batch in variants.values():  # warm-up
        trainer.step(batch.samples)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
        for variant in order:
            started = time.perf_counter()
            trainer.step(variants[variant].samples)
            times[variant].append(time.perf_counter() - started)
    turns = [len(t.turns) for t in trajectories]
    merged = variants["one sequence"]
    result: dict[str, Any] = {
        "model": name,
        "episodes": len(trajectories),
        "turns_mean": statistics.fmean(turns) if turns else 0.0,
        "multi_turn": sum(n > 1 for n in turns),
        "merged_trajectories": merged.merged_trajectories,
        "per_turn_trajectories": merged.per_turn_trajectories,
        "generation_s": generation_s,
        "logprob_max_abs_diff": agreement,
        "tokens_per_micro_batch": budget,
        "variants": {},
    }
    for variant, batch in variants.items():
        result["variants"][variant] = {
            **shape(batch.samples, budget),
            "step_s": times[variant],
            "step_s_median": statistics.median(times[variant]),
        }
    base = result["variants"]["per turn"]
    for figures in result["variants"].values():
        figures["time_vs_per_turn"] = figures["step_s_median"] / base["step_s_median"]
        figures["row_tokens_vs_per_turn"] = figures["row_tokens"] / base["row_tokens"]
    return result


def table(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| model | variant | samples | tokens run (rows) | padded | trained | micro-batches "
        "| step s (median) | x per turn (time) | x per turn (tokens run) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for variant, v in r["variants"].items():
            lines.append(
                f"| {r['model']} | {variant} | {v['samples']} | {v['row_tokens']:,} "
                f"| {v['padded_tokens']:,} | {v['trained_tokens']:,} | {v['micro_batches']} "
                f"| {v['step_s_median']:.3f} | {v['time_vs_per_turn']:.2f} "
                f"| {v['row_tokens_vs_per_turn']:.2f} |"
            )
    lines.append("")
    for r in results:
        lines.append(
            f"- {r['model']}: {r['episodes']} episodes, {r['turns_mean']:.1f} turns each on "
            f"average ({r['generation_s']:.0f} s to play); of the {r['multi_turn']} multi-turn "
            f"ones {r['merged_trajectories']} trained as one sequence, "
            f"{r['per_turn_trajectories']} per turn (their turns did not extend each other). "
            f"Trainer logprobs of the model's tokens, merged vs per turn: max |diff| "
            f"{r['logprob_max_abs_diff']:.1e}."
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8, help="per turn")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per variant")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results.append(measure(name.strip(), args, Path(tmp)))
    write_results(
        "multi_turn",
        args,
        "Multi-turn episodes: one sequence vs a sample per turn (trainer step)",
        table(results),
        results=results,
    )


if __name__ == "__main__":
    main()
