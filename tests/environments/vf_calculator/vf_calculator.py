"""A verifiers ToolEnv in the classic (0.3) API, as the Environments Hub publishes them, for
rlnode's verifiers adapter tests (tests/integration/test_env_verifiers.py); run it with the
verifiers-0.3 venv's python. It imports nothing of rlnode's.

"What is a * b + c?" with a `calculate` tool (Python arithmetic on integers); the model may
call it any number of times (at most 4 turns), then answers with the number alone. Rubric:
`correct_answer` (1 when the last reply's last number is the result). Training rows have
a, b, c in 2..9, eval rows in 11..19.
"""

from __future__ import annotations

import ast
import operator
import random
import re

import verifiers as vf
from datasets import Dataset

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """Evaluate an integer arithmetic expression with + - *.

    Args:
        expression: the expression, e.g. "3 * 4 + 5"
    """

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not integer arithmetic: {expression!r}")

    return str(value(ast.parse(expression, mode="eval").body))


def questions(low: int, high: int, count: int, seed: int) -> Dataset:
    operands = range(low, high + 1)
    triples = [(a, b, c) for a in operands for b in operands for c in operands]
    return Dataset.from_list(
        [
            {"question": f"What is {a} * {b} + {c}?", "answer": str(a * b + c)}
            for a, b, c in random.Random(seed).sample(triples, count)
        ]
    )


def load_environment(max_turns: int = 4):
    def correct_answer(completion, answer, **kwargs) -> float:
        replies = [m for m in completion if m.role == "assistant" and m.content]
        numbers = re.findall(r"-?\d+", replies[-1].content) if replies else []
        return 1.0 if numbers and numbers[-1] == answer else 0.0

    return vf.ToolEnv(
        dataset=questions(2, 9, 12, seed=3),
        eval_dataset=questions(11, 19, 6, seed=4),
        system_prompt="Use the calculate tool, then answer with the number alone.",
        tools=[calculate],
        max_turns=max_turns,
        rubric=vf.Rubric(funcs=[correct_answer]),
    )
