"""Samples/s and reward per sample with `max_async` 0 (synchronous, on-policy), 1 and 2 on
the full services: one node (embedded broker, vault, gateway with the managed copy-task Task
App, one rollout-generator, the learner), the same tiny model, task and config; the modes'
jobs run interleaved, `--repeats` rounds. Writes bench/results/async_modes.{json,md}.

    python bench/async_modes.py [--steps 12] [--prompts 8] [--group 8] [--repeats 3]

samples/s counts the rollouts of every step after the first, over the time from the first
`train.step` to the last (the first step also pays for loading the model: left out).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench_common import (
    GENERATOR_ENV,
    copy_task_node,
    job_config,
    training_arguments,
    write_results,
)

from rlnode.messages import JobConfig, JobEventType
from rlnode.models.build import init_tiny_model
from rlnode.sdk.jobs import JobsClient

MODES = (0, 1, 2)


async def run_job(jobs: JobsClient, config: JobConfig) -> dict:
    job_id = await jobs.start(config)
    steps: list[tuple[float, dict]] = []
    async for event in jobs.events(job_id, idle_timeout_s=300):
        if event.type is JobEventType.TRAIN_STEP:
            steps.append((time.perf_counter(), event.data))
        if event.type in (JobEventType.FAILED, JobEventType.REJECTED):
            raise RuntimeError(f"job {job_id}: {event.message}")
    per_step = config.training.prompts_per_step * config.training.group_size
    elapsed = steps[-1][0] - steps[0][0]
    rewards = [d["reward_mean"] for _t, d in steps]
    return {
        "job_id": job_id,
        "samples_per_s": per_step * (len(steps) - 1) / elapsed,
        "reward_first": statistics.fmean(rewards[:3]),
        "reward_last": statistics.fmean(rewards[-3:]),
        "staleness_mean": statistics.fmean(d["staleness_mean"] for _t, d in steps),
        "wait_s": sum(d["wait_s"] for _t, d in steps),
        "compute_s": sum(d["compute_s"] for _t, d in steps),
        "rewards": rewards,
    }


async def bench(node, org, model: Path, args) -> dict[int, list[dict]]:
    results: dict[int, list[dict]] = {m: [] for m in MODES}
    async with node.jobs(org) as jobs:
        await run_job(jobs, job_config(model, args, 1))  # warm-up: model load, connections
        for round_ in range(args.repeats):
            for mode in MODES:
                result = await run_job(jobs, job_config(model, args, mode))
                results[mode].append(result)
                print(
                    f"round {round_ + 1} max_async={mode}: {result['samples_per_s']:.1f} samples/s, "
                    f"reward {result['reward_first']:.3f} -> {result['reward_last']:.3f}",
                    flush=True,
                )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    training_arguments(parser, steps=12, max_async=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny_model(Path(tmp) / "tiny", seed=0)
        with copy_task_node(Path(tmp) / "node", GENERATOR_ENV) as (node, org):
            results = asyncio.run(bench(node, org, model, args))
    sync = statistics.median(r["samples_per_s"] for r in results[0])
    rows = []
    for mode in MODES:
        speeds = [r["samples_per_s"] for r in results[mode]]
        rows.append(
            {
                "max_async": mode,
                "samples_per_s_median": statistics.median(speeds),
                "samples_per_s_min": min(speeds),
                "samples_per_s_max": max(speeds),
                "ratio_vs_sync": statistics.median(speeds) / sync,
                "reward_gain_median": statistics.median(
                    r["reward_last"] - r["reward_first"] for r in results[mode]
                ),
                "staleness_mean": statistics.fmean(r["staleness_mean"] for r in results[mode]),
                "learner_wait_s_median": statistics.median(r["wait_s"] for r in results[mode]),
                "learner_compute_s_median": statistics.median(
                    r["compute_s"] for r in results[mode]
                ),
            }
        )
    table = [
        "| max_async | samples/s (median, min-max) | x sync | reward gain | staleness | learner waits / computes (s) |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['max_async']} | {r['samples_per_s_median']:.1f} ({r['samples_per_s_min']:.1f}-"
            f"{r['samples_per_s_max']:.1f}) | {r['ratio_vs_sync']:.2f} | {r['reward_gain_median']:+.3f} "
            f"| {r['staleness_mean']:.2f} | {r['learner_wait_s_median']:.1f} / {r['learner_compute_s_median']:.1f} |"
            for r in rows
        ),
    ]
    write_results(
        "async_modes",
        args,
        "max_async on the full services (one node, tiny model, copy task)",
        table,
        rows=rows,
        runs=results,
    )


if __name__ == "__main__":
    main()
