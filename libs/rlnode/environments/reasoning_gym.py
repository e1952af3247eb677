"""reasoning-gym's procedural tasks as a Task App (tested with reasoning-gym 0.1.25): one task
or a weighted mix, its dataset config, and its curriculum's levels, generated and scored by the
library itself (`create_dataset`, `create_curriculum`, `score_answer`, `extract_answer`).

    python -m rlnode.environments.reasoning_gym [--task chain_sum] [--processes 4]

env config (the job's `task_app.env_config`; each key overrides the command line's default):
- `task`: a dataset name ("chain_sum"), or `tasks`: {"chain_sum": 1, "gcd": 2} for a weighted
  mix (reasoning-gym's composite dataset); `config`: the dataset's own config fields, for one
  task ({"min_terms": 2}) or per task in a mix ({"gcd": {"max_value": 50}}).
- `level`: a curriculum level: each task's config from `create_curriculum(task)` at that
  global level, then `config` on top. The job's `[task_app.curriculum]` writes it (the
  learner raises it as the reward passes a threshold; rlnode.training.curriculum).
- `system_prompt`: a name from reasoning-gym's SYSTEM_PROMPTS (default "default"), any other
  text, or "" for none; `answer`: "tags" (default: the reply's `<answer>` tags, as the
  library's prompts ask; no tags scores 0) or "text" (the whole reply).
- `shots` (default 0): worked examples before the question, as earlier turns of the chat
  (the library's question, its answer in the form `answer` asks for): training questions
  of seeds just below `heldout_from`, the same for every seed. A small model that answers
  every question with an essay (SmolLM2-135M: 0 of 64 right on chain_sum) answers in the
  asked form after two (and so can be scored).
- `heldout_from` (default 1,000,000): seeds from here on get held-out questions, below it
  training ones.

Seeds: seed s is the dataset's item s (the library seeds item i of a dataset of seed 0 with
i, so one seed is one question whatever the size). Distinct seeds can still ask the same
question where a level has few (two one-digit terms), so questions are split in two by a hash
of their text, one in five held out: a training seed takes the first training question among
its items s*64 .. s*64+63, an evaluation seed the first held-out one. A held-out round is
then never a question training saw.

Reward: `score_answer` (1.0 right; some tasks give partial credit). metrics.details:
`correct` (score 1), `level`, and `correct/<task>` in a mix (per-task accuracy in train.step).
Episodes run in worker processes (rlnode.taskapp.Isolated): some generators loop forever on
some configs (base_conversion with min_base == max_base) and some scorers raise on a
malformed answer (prime_factorization); either fails that rollout, not the app.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import sys
from typing import Any

from rlnode.taskapp import Episode, Isolated, TaskAppDefinition, serve

HELDOUT_FROM = 1_000_000
HELDOUT_SHARE = 5  # one question in five is held out
DRAWS = 64  # items a seed may look through for a question of its half
SIZE = 2**62  # the dataset's size: any item index a seed reaches


def _library() -> Any:
    import reasoning_gym  # imported in the workers, where episodes run

    return reasoning_gym


def task_names(config: dict[str, Any], default_task: str | None) -> dict[str, float]:
    """The tasks of an env config and their weights."""
    if "tasks" in config:
        tasks = config["tasks"]
        if not isinstance(tasks, dict) or not tasks:
            raise ValueError('env config "tasks" must map task names to weights, e.g. {"gcd": 1}')
        return {str(name): float(weight) for name, weight in tasks.items()}
    task = config.get("task", default_task)
    if not task:
        raise ValueError('name a reasoning-gym task: env config {"task": "chain_sum"} or --task')
    return {str(task): 1.0}


def task_config(name: str, level: int | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """A task's dataset config: its curriculum at `level` (if given), then `overrides`."""
    from reasoning_gym.factory import DATASETS, create_curriculum

    if name not in DATASETS:
        raise ValueError(
            f"reasoning-gym has no task {name!r}: pick one of reasoning_gym.factory.DATASETS "
            f"({len(DATASETS)} tasks, e.g. chain_sum, gcd, letter_counting)"
        )
    config: dict[str, Any] = {}
    if level is not None:
        try:
            curriculum = create_curriculum(name)
        except Exception:
            raise ValueError(
                f"reasoning-gym's task {name!r} has no curriculum: drop `level` "
                "(task_app.curriculum) or pick a task that has one"
            ) from None
        curriculum.set_global_level(level)
        generated = curriculum.generate_configuration()
        config = {f.name: getattr(generated, f.name) for f in dataclasses.fields(generated)}
    config.update(overrides)
    config.pop("seed", None), config.pop("size", None)
    return config


@functools.lru_cache(maxsize=32)
def dataset(spec: str) -> Any:
    """The dataset of a (JSON) spec, built once per worker: tasks, their configs and level."""
    rg = _library()
    tasks, configs, level = json.loads(spec)
    if len(tasks) == 1:
        (name,) = tasks
        return rg.create_dataset(name, seed=0, size=SIZE, **task_config(name, level, configs))
    from reasoning_gym.composite import DatasetSpec

    specs = [
        DatasetSpec(
            name=name, weight=weight, config=task_config(name, level, configs.get(name, {}))
        )
        for name, weight in tasks.items()
    ]
    return rg.create_dataset("composite", seed=0, size=SIZE, datasets=specs)


def held_out(question: str) -> bool:
    digest = hashlib.blake2b(question.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") % HELDOUT_SHARE == 0


def item(data: Any, seed: int, heldout_from: int) -> dict[str, Any]:
    """The question of `seed`: the first of its items in the seed's half (see the docstring)."""
    if seed < 0:
        raise ValueError(f"seed {seed}: reasoning-gym items are numbered from 0")
    want_heldout = seed >= heldout_from
    for index in range(seed * DRAWS, (seed + 1) * DRAWS):
        entry = data[index]
        if held_out(entry["question"]) == want_heldout:
            return dict(entry)
    half = "held-out" if want_heldout else "training"
    raise ValueError(
        f"seed {seed}: no {half} question in {DRAWS} draws: this task and level ask too few "
        "distinct questions to hold some out; raise the level or widen its config"
    )


def worked_examples(data: Any, config: dict[str, Any], mode: str) -> list[dict[str, str]]:
    """`shots` earlier turns: training questions of the seeds just below `heldout_from`
    (the end of the training range, which no job reaches) with the library's answers."""
    shots = int(config.get("shots", 0))
    if not 0 <= shots <= 16:
        raise ValueError(f'env config "shots" is {shots}: give 0 to 16 worked examples')
    heldout_from = int(config.get("heldout_from", HELDOUT_FROM))
    turns: list[dict[str, str]] = []
    for seed in range(heldout_from - shots, heldout_from):
        shot = item(data, seed, heldout_from)
        answer = str(shot["answer"])
        turns.append({"role": "user", "content": shot["question"]})
        turns.append(
            {
                "role": "assistant",
                "content": f"<answer>{answer}</answer>" if mode == "tags" else answer,
            }
        )
    return turns


def build(task: str | None = None) -> TaskAppDefinition:
    def spec_of(config: dict[str, Any]) -> str:
        tasks = task_names(config, task)
        configs = config.get("config", {})
        if not isinstance(configs, dict):
            raise ValueError('env config "config" must be an object of dataset config fields')
        level = config.get("level")
        return json.dumps([tasks, configs, level if level is None else int(level)])

    def make_task(seed: int, config: dict[str, Any]) -> dict[str, Any]:
        entry = item(dataset(spec_of(config)), seed, int(config.get("heldout_from", HELDOUT_FROM)))
        return {
            "question": entry["question"],
            "answer": entry["answer"],
            "task": entry["metadata"].get("source_dataset"),
            "level": config.get("level"),
        }

    async def run_episode(task_: dict[str, Any], episode: Episode) -> None:
        from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

        config = episode.config
        data = dataset(spec_of(config))
        entry = item(data, episode.seed, int(config.get("heldout_from", HELDOUT_FROM)))
        prompt = config.get("system_prompt", "default")
        system = SYSTEM_PROMPTS.get(prompt, prompt)
        mode = config.get("answer", "tags")
        if mode not in ("tags", "text"):
            raise ValueError(f'env config "answer" is {mode!r}: use "tags" or "text"')
        messages = [{"role": "system", "content": system}] if system else []
        messages += worked_examples(data, config, mode)
        messages.append({"role": "user", "content": entry["question"]})
        reply = await episode.chat(messages)
        answer = extract_answer(reply.text) if mode == "tags" else reply.text.strip()
        score = float(data.score_answer(answer, entry))
        info: dict[str, Any] = {
            "answer": answer,
            "expected": entry["answer"],
            "correct": score >= 1,
        }
        episode.step({"messages": messages}, reply.text, score, done=True, info=info)
        episode.details["correct"] = float(score >= 1.0)
        if "tasks" in config:
            episode.details[f"correct/{task_['task']}"] = float(score >= 1.0)
        if task_["level"] is not None:
            episode.details["level"] = float(task_["level"])

    return TaskAppDefinition(
        name="reasoning-gym",
        description="reasoning-gym's procedural tasks, generated and scored by the library.",
        make_task=make_task,
        run_episode=run_episode,
        dataset={
            "seeds": f"training: 0 to {HELDOUT_FROM - 1}; held-out: {HELDOUT_FROM} and up",
            "config": {"task": task or "chain_sum", "level": None, "answer": "tags"},
        },
        rubric={"outcome": "reasoning-gym's score_answer of the <answer> tags (1.0 right)"},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    parser.add_argument("--task", help="default task when the env config names none")
    parser.add_argument("--processes", type=int, default=4, help="worker processes")
    args, rest = parser.parse_known_args(argv)
    return serve(Isolated(build, {"task": args.task}, processes=args.processes), rest)


if __name__ == "__main__":
    sys.exit(main())
