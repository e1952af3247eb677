"""B8 — the control plane's ceiling: the full node (broker, vault, gateway, managed Task App,
generator, learner) with an engine that answers at once with fixed tokens (`GENERATOR_ENGINE
=instant`) and the copy task's Task App (one inference call and a string comparison), so that
what is left is what the services cost around generation and training. Every rollout of a
group gets the same reward, so the learner trains nothing and its CPU is bookkeeping.

Reports rollouts/s and CPU milliseconds per rollout of each process (user + system, from
/proc, over the steps after the first few), the broker and the Task App included. Writes
bench/results/control_plane.{json,md}.

    python bench/control_plane.py [--steps 30] [--prompts 16] [--group 16] [--warmup 3]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import psutil
from bench_common import copy_task_node, job_config, training_arguments, write_results

from rlnode.messages import JobEventType
from rlnode.models.build import init_tiny_model
from rlnode.node.chaos import BROKER, pid_of, targets, task_app_target


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each process has used so far (its threads included)."""
    used = {}
    for name, pid in pids.items():
        times = psutil.Process(pid).cpu_times()
        used[name] = times.user + times.system
    return used


async def run(node, org, model: Path, args, pids: dict[str, int]) -> dict:
    config = job_config(model, args)
    per_step = args.prompts * args.group
    marks: list[tuple[int, float, dict[str, float]]] = []
    async with node.jobs(org) as jobs:
        job_id = await jobs.start(config)
        async for event in jobs.events(job_id, idle_timeout_s=300):
            if event.type is JobEventType.TRAIN_STEP:
                step = event.data["step"]
                if step == args.warmup or step == args.steps:
                    marks.append((step, time.perf_counter(), cpu_seconds(pids)))
                if step == args.steps:
                    break
            if event.type in (JobEventType.FAILED, JobEventType.REJECTED):
                raise RuntimeError(f"job {job_id}: {event.message}")
    (first, started, before), (last, ended, after) = marks
    rollouts = (last - first) * per_step
    cpu_ms = {name: 1000 * (after[name] - before[name]) / rollouts for name in pids}
    return {
        "job_id": job_id,
        "rollouts": rollouts,
        "seconds": ended - started,
        "rollouts_per_s": rollouts / (ended - started),
        "cpu_ms_per_rollout": cpu_ms,
        "cpu_ms_per_rollout_total": sum(cpu_ms.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    training_arguments(parser, steps=30, max_async=2)
    parser.set_defaults(prompts=16, group=16)
    parser.add_argument("--warmup", type=int, default=3, help="steps before the measurement")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    generator = {
        "GENERATOR_ENGINE": "instant",
        "GENERATOR_CONCURRENCY": "256",
        "GENERATOR_MAX_BATCH_SIZE": "256",
    }
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny_model(Path(tmp) / "tiny", seed=0)
        with copy_task_node(Path(tmp) / "node", generator) as (node, org):
            task_app = task_app_target(org, "copy")
            pids = {
                name.removeprefix("taskapp:").replace(f"{org.org_id}/", ""): pid_of(
                    node, name, {org.org_id: org}
                )
                for name in targets(node, [task_app])
            }
            pids = {("broker (Tansu)" if k == BROKER else k): v for k, v in pids.items()}
            for round_ in range(args.repeats):
                result = asyncio.run(run(node, org, model, args, pids))
                runs.append(result)
                print(
                    f"round {round_ + 1}: {result['rollouts_per_s']:.0f} rollouts/s, "
                    f"{result['cpu_ms_per_rollout_total']:.2f} CPU ms per rollout",
                    flush=True,
                )
    best = min(runs, key=lambda r: r["cpu_ms_per_rollout_total"])
    names = list(best["cpu_ms_per_rollout"])
    table = [
        "| process | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |",
        "|---|" + "---|" * len(runs),
        *(
            f"| {name} | " + " | ".join(f"{r['cpu_ms_per_rollout'][name]:.2f}" for r in runs) + " |"
            for name in names
        ),
        "| **total CPU ms per rollout** | "
        + " | ".join(f"**{r['cpu_ms_per_rollout_total']:.2f}**" for r in runs)
        + " |",
        "| rollouts/s | " + " | ".join(f"{r['rollouts_per_s']:.0f}" for r in runs) + " |",
        "",
        f"CPU milliseconds per rollout of each process over steps {args.warmup}..{args.steps}"
        f" ({args.prompts} prompts x {args.group} samples a step), with an engine that answers "
        "at once: what the services cost around generation (goal: 2 ms in all).",
    ]
    write_results(
        "control_plane",
        args,
        "B8: the control plane's cost per rollout (instant engine, copy-task Task App)",
        table,
        runs=runs,
    )


if __name__ == "__main__":
    main()
