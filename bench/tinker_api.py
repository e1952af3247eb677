"""B14: a Tinker API training loop on a node against the same task as an rlnode job.

tinker-cookbook's math_rl recipe (0.6.1, unchanged: arithmetic, importance_sampling, LoRA)
trains SmolLM2-135M-Instruct through the node's tinker-api; an rlnode job of the same shape
(the arithmetic Task App on sums of operands up to 100, as the recipe's; the same prompts per
step, group, learning rate, LoRA rank, completion length and steps) trains it through the
same node. One node, one torch generator, the systems one after the other.

Per system: the training reward per step; held-out accuracy before and after (the recipe's
questions, x + y with x, y in 0..100, from a seed the recipe never draws, greedy; the job's
own evaluation rounds on held-out seeds); seconds per step. The API's step is split into
the recipe's sampling, its train step (forward_backward and optim_step as the learner spent
them, `server/*` in its metrics, and the rest: client and transport), and save-for-sampler;
the job's into generation, training and the rest. Writes bench/results/tinker.{json,md,png}.

    python bench/tinker_api.py [--steps 8] [--prompts 4] [--group 4] [--lr 1e-4] [--rank 8]
                           [--max-tokens 8] [--eval-questions 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import RESULTS, write_results
from real_model import rlnode_job, run_rlnode

from rlnode.messages.config import LoraSpec
from rlnode.models.catalogue import packaged_gguf
from rlnode.models.gguf import import_gguf
from rlnode.service.auth import TINKER_KEY_PREFIX, Scope

ENV_CONFIG = {"max_operand": 100, "operations": "+"}
HELDOUT_SEED = 424_242  # the recipe seeds its batches with their index: 0, 1, 2, ...
RENDERER = "qwen3_instruct"


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4, help="questions per step")
    parser.add_argument("--group", type=int, default=4, help="samples per question")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--eval-questions", type=int, default=32)
    parser.add_argument("--target", type=float, default=0.5, help="held-out accuracy to reach")
    parser.add_argument(
        "--max-async",
        type=int,
        default=1,
        help="steps sampling may run ahead of training: the job's max_async and the recipe's "
        "max_steps_off_policy (0: both synchronous)",
    )
    parser.add_argument(
        "--loss", default="ppo", help="the recipe's loss_fn (the job's grpo clips as ppo does)"
    )
    parser.add_argument("--temperature", type=float, default=0.7, help="the job's")
    args = parser.parse_args()
    # The job evaluates at its start and end, on as many held-out questions as the API run.
    args.eval_every, args.eval_seeds = args.steps, args.eval_questions
    return args


# -- the Tinker API: the recipe, and a held-out check through the SDK --------------------------


def run_recipe(node, key: str, model: Path, args, log_path: Path) -> dict:
    env = {
        **os.environ,
        "TINKER_BASE_URL": node.url("tinker-api"),
        "TINKER_API_KEY": key,
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
    }
    command = [
        sys.executable,
        "-m",
        "tinker_cookbook.recipes.math_rl.train",
        "env=arithmetic",
        f"model_name={model}",
        f"renderer_name={RENDERER}",
        f"loss_fn={args.loss}",
        f"group_size={args.group}",
        f"groups_per_batch={args.prompts}",
        f"max_tokens={args.max_tokens}",
        f"lora_rank={args.rank}",
        f"learning_rate={args.lr}",
        f"max_steps={args.steps}",
        "eval_every=0",
        "save_every=0",
        f"log_path={log_path}",
        "behavior_if_log_dir_exists=delete",
    ]
    if args.max_async:  # sampling runs ahead of training, as the job's generators do
        command.append(f"max_steps_off_policy={args.max_async}")
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=7200)
    wall_s = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"the recipe failed:\n{(result.stdout + result.stderr)[-3000:]}")
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").open()]
    steps = []
    for row in rows:
        if "time/total" not in row:
            continue
        passes = row.get("server/forward_backward_s", 0.0)
        optim = row.get("server/optim_step_s", 0.0)
        steps.append(
            {
                "step": row["training_client/step"] + 1,  # "step" counts from 1 already
                "reward_mean": row["env/all/reward/total"],
                "correct": row["env/all/correct"],
                "total_s": row["time/total"],
                # Async: sampling runs beside training (time/sampling is then absent; a
                # group's sampling took time/sampling_time_mean), and the step waits for it
                # only when it fell behind.
                "sampling_s": row.get("time/sampling", row.get("time/sampling_time_mean", 0.0)),
                "train_step_s": row.get("time/train_step", 0.0),
                "forward_backward_s": passes,
                "optim_step_s": optim,
                "save_for_sampler_s": row.get("time/save_checkpoint_and_get_sampling_client", 0.0),
                "timings": {k: v for k, v in row.items() if k.startswith("time/")},
            }
        )
    saved = [json.loads(line) for line in (log_path / "checkpoints.jsonl").open()]
    return {"steps": steps, "wall_s": wall_s, "sampler_path": saved[-1]["sampler_path"]}


def heldout_accuracy(node, key: str, model: Path, args, sampler_path: str | None) -> float:
    """Greedy accuracy on questions the recipe never asks, written as the recipe writes
    them (its few-shot example, its renderer), through the SDK."""
    import tinker
    from tinker import types
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    renderer = renderers.get_renderer(RENDERER, get_tokenizer(str(model)))
    service = tinker.ServiceClient(base_url=node.url("tinker-api"), api_key=key)
    sampler = (
        service.create_sampling_client(model_path=sampler_path).result()
        if sampler_path
        else service.create_sampling_client(base_model=str(model)).result()
    )
    rng = random.Random(HELDOUT_SEED)
    right = 0
    params = types.SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, stop=renderer.get_stop_sequences()
    )
    futures = []
    envs = []
    for _ in range(args.eval_questions):
        x, y = rng.randint(0, 100), rng.randint(0, 100)
        env = ArithmeticEnv(x, y, renderer, convo_prefix=ArithmeticEnv.standard_fewshot_prefix())
        convo = [
            *ArithmeticEnv.standard_fewshot_prefix(),
            {"role": "user", "content": env.get_question()},
        ]
        prompt = renderer.build_generation_prompt(convo)
        futures.append(sampler.sample(prompt, num_samples=1, sampling_params=params))
        envs.append(env)
    for env, future in zip(envs, futures, strict=True):
        tokens = future.result().sequences[0].tokens
        message, _termination = renderer.parse_response(tokens)
        right += env.check_answer(renderers.get_text_content(message))
    service.close("success")
    return right / args.eval_questions


# -- the run ---------------------------------------------------------------------------------


def main() -> None:
    args = arguments()
    from rlnode.node.local import LocalNode, NodeOptions
    from rlnode.sdk.vault import VaultClient

    workdir = Path(tempfile.mkdtemp(prefix="bench-tinker-"))
    store = workdir / "models"
    import_gguf(packaged_gguf("smollm2-135m-instruct"), store, "float32")
    (model,) = store.iterdir()
    options = NodeOptions(
        data_dir=workdir / "node",
        services=(
            "credential-vault",
            "taskapp-gateway",
            "rollout-generator",
            "learner",
            "tinker-api",
        ),
        env={"tinker-api": {"TINKER_API_BASE_MODELS": json.dumps({str(model): str(model)})}},
    )
    with LocalNode(options) as node:
        org = node.create_org("bench", {"ENVIRONMENT_API_KEY": f"bench-key-{time.time_ns()}"})
        node.register_example_task_app(org, "arithmetic", "arithmetic")
        with VaultClient(node.url("credential-vault"), org.token) as vault:
            key = TINKER_KEY_PREFIX + vault.create_token("bench", [Scope.TINKER.value])["token"]
        before = heldout_accuracy(node, key, model, args, None)
        api = run_recipe(node, key, model, args, workdir / "math_rl")
        api["heldout_before"] = before
        api["heldout_after"] = heldout_accuracy(node, key, model, args, api["sampler_path"])
        # The same task as a job: real_model's arithmetic job, sums to 100, LoRA adapters.
        lora = LoraSpec(rank=args.rank, alpha=32)
        job = rlnode_job(model, args, env_config=ENV_CONFIG, lora=lora)
        job = asyncio.run(run_rlnode(node, org, model, args, job))
    report(api, job, args)


def report(api: dict, job: dict, args) -> None:
    def mean(rows: list[dict], key: str) -> float:
        return statistics.fmean(r[key] for r in rows) if rows else 0.0

    def ends(rows: list[dict], end: int) -> float:  # the mean reward of the first/last 5
        part = rows[:5] if end == 0 else rows[-5:]
        return statistics.fmean(r["reward_mean"] for r in part)

    steps = api["steps"]
    api_step = mean(steps, "total_s")
    job_steps = job["steps"]
    starts = [0.0] + [s["t"] for s in job_steps[:-1]]
    job_step = statistics.fmean(s["t"] - t0 for s, t0 in zip(job_steps, starts, strict=True))
    learner = mean(steps, "forward_backward_s") + mean(steps, "optim_step_s")
    table = [
        f"{args.steps} steps of {args.prompts} questions x {args.group} samples, LoRA rank "
        f"{args.rank}, lr {args.lr}, {args.max_tokens} tokens; held-out: greedy on "
        f"{args.eval_questions} questions.",
        "",
        "| system | held-out before -> after | reward, first 5 -> last 5 steps | seconds per step |",
        "|---|---|---|---|",
        f"| Tinker API (math_rl recipe) | {api['heldout_before']:.3f} -> {api['heldout_after']:.3f} "
        f"| {ends(steps, 0):.3f} -> {ends(steps, -1):.3f} | {api_step:.1f} |",
        f"| rlnode job | {job['evals'][0]['accuracy']:.3f} -> {job['evals'][-1]['accuracy']:.3f} "
        f"| {ends(job_steps, 0):.3f} -> {ends(job_steps, -1):.3f} "
        f"| {job_step:.1f} |",
        "",
        f"API per step over the job's: **{api_step / job_step:.2f}x** (goal: at most 1.2x).",
        "",
        "Rewards are each system's own: the recipe's 1 for the right sum and -0.1 for an "
        "answer it cannot parse; the arithmetic Task App's 0.8 for the right sum plus 0.2 for "
        "the number alone. Held-out accuracy, greedy: for the API the recipe's own questions "
        "and prompt from a seed it never draws; for the job its evaluation on held-out seeds.",
        "",
        "Seconds per step of the API run: sampling "
        f"{mean(steps, 'sampling_s'):.2f} ({'beside' if args.max_async else 'before'} "
        f"training), train step {mean(steps, 'train_step_s'):.2f} (the "
        f"learner's forward_backward {mean(steps, 'forward_backward_s'):.2f} and optim_step "
        f"{mean(steps, 'optim_step_s'):.2f}; client and transport "
        f"{mean(steps, 'train_step_s') - learner:.2f}), save-for-sampler "
        f"{mean(steps, 'save_for_sampler_s'):.2f}. The job's: generation "
        f"{mean(job_steps, 'generation_s'):.2f}, training {mean(job_steps, 'training_s'):.2f}.",
        "",
        "![reward per step](tinker.png)",
    ]
    plot(api, job, RESULTS / "tinker.png")
    write_results(
        "tinker",
        args,
        "B14: the Tinker API (tinker-cookbook's math_rl) against an rlnode job, SmolLM2",
        table,
        api=api,
        job=job,
    )


def plot(api: dict, job: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(
        [s["step"] for s in api["steps"]],
        [s["reward_mean"] for s in api["steps"]],
        marker=".",
        label="Tinker API (math_rl)",
    )
    axes.plot(
        [s["step"] for s in job["steps"]],
        [s["reward_mean"] for s in job["steps"]],
        marker=".",
        label="rlnode job",
    )
    axes.set(xlabel="step", ylabel="mean training reward", title="SmolLM2 on sums, 2 CPU cores")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
