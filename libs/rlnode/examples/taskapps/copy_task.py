"""Copy task: repeat a short random string. Reward = fraction of positions that match
(over the longer of answer and target), so a tiny random model gets partial credit from
the first step and learns quickly.

    ENVIRONMENT_API_KEY=... PORT=8101 python -m rlnode.examples.taskapps.copy_task

env config: {"length": 4, "alphabet": "abcd"}
"""

from __future__ import annotations

import random
import sys
from typing import Any

from rlnode.taskapp import TaskAppDefinition, serve, single_turn

DEFAULT_LENGTH = 4
DEFAULT_ALPHABET = "abcd"


def make_task(seed: int, config: dict[str, Any]) -> dict[str, Any]:
    length = int(config.get("length", DEFAULT_LENGTH))
    alphabet = str(config.get("alphabet", DEFAULT_ALPHABET))
    rng = random.Random(seed)
    return {"target": "".join(rng.choice(alphabet) for _ in range(length)), "alphabet": alphabet}


def prompt(task: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Copy: {task['target']}"}]


def reward(task: dict[str, Any], answer: str) -> float:
    target, answer = task["target"], answer.strip()
    if not answer:
        return 0.0
    matches = sum(a == b for a, b in zip(answer, target, strict=False))
    return matches / max(len(target), len(answer))


DEFINITION = TaskAppDefinition(
    name="copy-task",
    description="Repeat a short random string; partial credit per matching character.",
    make_task=make_task,
    run_episode=single_turn(prompt, reward),
    dataset={
        "seeds": "any integer",
        "config": {"length": DEFAULT_LENGTH, "alphabet": DEFAULT_ALPHABET},
    },
    rubric={"outcome": "fraction of characters in the right place"},
)

if __name__ == "__main__":
    sys.exit(serve(DEFINITION))
