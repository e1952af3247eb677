"""What every benchmark records beside its numbers: the machine, the versions, the exact
command; and one way to write results (JSON + a markdown table) to bench/results/."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    versions = {"python": platform.python_version()}
    for package in ("torch", "transformers", "aiokafka", "trl"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=RESULTS.parent,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "gpu": gpu,
        "versions": versions,
        "commit": commit,
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def own_status_bytes(field: str) -> int:
    """A byte figure of this process's /proc/self/status (VmRSS, VmHWM)."""
    return status_bytes("self", field)


def status_bytes(pid: int | str, field: str) -> int:
    """A byte figure of /proc/<pid>/status (VmRSS, VmHWM: the peak RSS since it started)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_own_peak() -> None:
    """This process's VmHWM back to its current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def write_results(name: str, args, title: str, table: list[str], **result: Any) -> Path:
    """bench/results/NAME.json (the machine, the configuration `args` and `result`) and
    NAME.md (the title, the command that repeats the run, the machine, `table`); prints
    the table."""
    m = machine()
    script = Path(sys.argv[0]).name
    command = f"python bench/{script} " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(
        json.dumps({"machine": m, "config": vars(args), **result}, indent=2, default=str) + "\n"
    )
    lines = [
        f"# {title}",
        "",
        f"`{command}` — {m['when']}, commit {m['commit'] or '?'}, {m['cpu_count']} CPUs"
        + (f", {m['gpu']}" if m["gpu"] else ", no GPU")
        + ", "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
        "",
        *table,
        "",
    ]
    path = RESULTS / f"{name}.md"
    path.write_text("\n".join(lines))
    print("\n".join(table))
    return path


# The generator of the training benchmarks: rollouts in flight and batched together up to a
# whole step's (the in-process loop's engine batches 256; at the default 32 a 128-sample step
# was generated in four passes where TRL and the in-process loop take one).
GENERATOR_ENV = {"GENERATOR_CONCURRENCY": "256", "GENERATOR_MAX_BATCH_SIZE": "256"}


@contextmanager
def copy_task_node(
    directory: Path,
    generator_env: dict[str, str],
    gateways: int = 1,
    kafka_bootstrap: str | None = None,
) -> Iterator[tuple]:
    """A node for training benchmarks (no checkpoint-server), an org whose key is sealed
    and uploaded, and the managed copy-task Task App registered as "copy": (node, org).
    `kafka_bootstrap`: a broker of the user's own instead of the node's."""
    import time

    from rlnode.node.local import LocalNode, NodeOptions

    with LocalNode(
        NodeOptions(
            data_dir=directory,
            services=("credential-vault", "taskapp-gateway", "rollout-generator", "learner"),
            env={"rollout-generator": generator_env},
            gateways=gateways,
            kafka_bootstrap=kafka_bootstrap,
        )
    ) as node:
        org = node.create_org("bench", {"ENVIRONMENT_API_KEY": f"bench-key-{time.time_ns()}"})
        node.register_example_task_app(org, "copy", "copy_task")
        yield node, org


def job_config(model: Path, args, max_async: int | None = None):
    """The copy-task job for the training arguments below (`max_async` None: args')."""
    from rlnode.examples import example_job

    return example_job(
        "copy_task",
        model,
        steps=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group,
        optimizer={
            "lr": args.lr,
            "schedule": {
                key: getattr(args, key)
                for key in ("warmup_steps", "decay", "min_lr_ratio")
                if getattr(args, key, None) is not None
            },
        },
        minibatches=args.minibatches,
        max_async=args.max_async if max_async is None else max_async,
        checkpoint_every=1000,
        algorithm=getattr(args, "algorithm", "grpo"),
        lora={
            "rank": args.lora_rank,
            "alpha": 2 * args.lora_rank,
            "modules_to_save": [m for m in args.lora_modules_to_save.split(",") if m],
        }
        if getattr(args, "lora_rank", 0)
        else None,
    )


def training_arguments(parser, steps: int, max_async: int | None) -> None:
    """The training knobs the training benchmarks share (same names, same meaning);
    `max_async` None: the benchmark sweeps it itself."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument(
        "--minibatches", type=int, default=1, help="optimizer steps per training step"
    )
    # Constant by default, unlike the copy task's file: TRL runs at a constant rate beside
    # these, and the results so far were measured so.
    parser.add_argument("--warmup-steps", type=int, default=0, help="lr warmup steps")
    parser.add_argument(
        "--decay", default="constant", help="lr after the warmup: constant, linear or cosine"
    )
    parser.add_argument("--min-lr-ratio", type=float, default=0.0, help="where a decay ends")
    if max_async is not None:
        parser.add_argument("--max-async", type=int, default=max_async)
    parser.add_argument(
        "--algorithm", default="grpo", help="training.algorithm (grpo, dr_grpo, dapo, gspo)"
    )
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: all weights)"
    )
    parser.add_argument(
        "--lora-modules-to-save",
        default="",
        help="with LoRA, modules trained in full too (comma-separated, e.g. embed_tokens)",
    )


def trl_grpo_config(out: Path, *, steps: int, batch: int, bf16: bool = False, **varied: Any):
    """TRL's GRPOConfig with rlnode's loss (token-mean over the batch, clip 0.2, group std
    scaling, no KL), a constant learning rate and no saving, logging or progress bars, for
    the benchmarks that run TRL against rlnode; `bf16`: TRL's (Accelerate's) bf16 mixed
    precision, autocast over fp32 weights, which a user on a CPU with native bf16 would turn
    on; `varied`: what each benchmark sets itself (num_generations, learning_rate,
    temperature, max_completion_length, seed, ...)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",  # the token-mean over the batch, as rlnode's learner
        scale_rewards="group",
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=bf16,
        disable_tqdm=True,
        **varied,
    )
