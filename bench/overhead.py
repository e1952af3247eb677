"""B3 — what the services cost: the same training (tiny model, copy task, same config) run
through the full node (broker, gateway, Task App process, generator, learner) and in one
process (bench/inprocess.py: the learner's own job loop on the in-memory transport, the copy
task's Task App code and the same torch engine, in-process),
interleaved in one invocation. Writes bench/results/overhead.{json,md}.

    python bench/overhead.py [--steps 10] [--prompts 8] [--group 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from async_modes import run_job
from bench_common import (
    GENERATOR_ENV,
    copy_task_node,
    job_config,
    training_arguments,
    write_results,
)
from inprocess import loop_config, run_loop

from rlnode.models.build import init_tiny_model
from rlnode.sdk.jobs import JobsClient


def inprocess_rate(model: Path, args, scratch: Path) -> float:
    with tempfile.TemporaryDirectory(dir=scratch) as root:  # a fresh job: no checkpoint to resume
        records = asyncio.run(run_loop(model, loop_config(model, args), Path(root)))
    per_step = args.prompts * args.group
    # Like the services' figure: from the first step's end to the last's.
    return per_step * (len(records) - 1) / (records[-1].elapsed_s - records[0].elapsed_s)


async def services_rate(jobs: JobsClient, model: Path, args) -> float:
    return (await run_job(jobs, job_config(model, args)))["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    training_arguments(parser, steps=10, max_async=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {"services": [], "in-process": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny_model(Path(tmp) / "tiny", seed=0)
        with copy_task_node(Path(tmp) / "node", GENERATOR_ENV) as (node, org):

            async def services_round() -> float:
                async with node.jobs(org) as jobs:
                    return await services_rate(jobs, model, args)

            asyncio.run(services_round())  # warm-up: the generator loads the model
            for round_ in range(args.repeats):
                runs["services"].append(asyncio.run(services_round()))
                runs["in-process"].append(inprocess_rate(model, args, Path(tmp)))
                print(
                    f"round {round_ + 1}: services {runs['services'][-1]:.1f}, in-process "
                    f"{runs['in-process'][-1]:.1f} samples/s",
                    flush=True,
                )
    median = {k: statistics.median(v) for k, v in runs.items()}
    slower = 1 - median["services"] / median["in-process"]
    table = [
        "| path | samples/s (median) | runs |",
        "|---|---|---|",
        *(
            f"| {k} | {median[k]:.1f} | {', '.join(f'{x:.1f}' for x in v)} |"
            for k, v in runs.items()
        ),
        "",
        f"The services are **{slower:.0%} slower** than the in-process loop (goal: at most 5%).",
    ]
    write_results(
        "overhead",
        args,
        "B3: full services vs the in-process loop (tiny model, copy task)",
        table,
        runs=runs,
        median=median,
    )


if __name__ == "__main__":
    main()
