"""Arithmetic: one question ("What is 37 + 48?"), reward 1 when the last integer in the
answer is right. For real models; too hard for the tiny one.

    ENVIRONMENT_API_KEY=... PORT=8103 python -m rlnode.examples.taskapps.arithmetic

env config: {"max_operand": 99, "operations": "+-*"}
"""

from __future__ import annotations

import operator
import random
import re
import sys
from typing import Any

from rlnode.taskapp import TaskAppDefinition, serve, single_turn

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
INTEGER = re.compile(r"-?\d+")


def make_task(seed: int, config: dict[str, Any]) -> dict[str, Any]:
    rng = random.Random(seed)
    high = int(config.get("max_operand", 99))
    symbol = rng.choice(str(config.get("operations", "+-*")))
    a, b = rng.randint(0, high), rng.randint(0, high)
    return {"question": f"What is {a} {symbol} {b}?", "answer": OPERATIONS[symbol](a, b)}


def prompt(task: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Solve the problem. End your answer with the final number."},
        {"role": "user", "content": task["question"]},
    ]


def reward(task: dict[str, Any], answer: str) -> float:
    numbers = INTEGER.findall(answer.replace(",", ""))
    return 1.0 if numbers and int(numbers[-1]) == task["answer"] else 0.0


DEFINITION = TaskAppDefinition(
    name="arithmetic",
    description="Integer arithmetic; reward 1 for the right final number.",
    make_task=make_task,
    run_episode=single_turn(prompt, reward),
    dataset={"seeds": "any integer", "config": {"max_operand": 99, "operations": "+-*"}},
    rubric={"outcome": "1 if the last integer in the answer is correct"},
)

if __name__ == "__main__":
    sys.exit(serve(DEFINITION))
