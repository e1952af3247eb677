"""An OpenReward environment server written with OpenReward's own server-side SDK
(`openreward.environments`), as a user writes one, for the adapter's tests
(tests/integration/test_env_openreward.py). Run it with the OpenReward venv's python:

    OPENREWARD_DISABLE_UPDATE_CHECK=1 .venvs/openreward/bin/python \
        tests/environments/openreward_arithmetic.py --port 8080

It serves three environments (routed by their lowercase class names):
- `arithmeticenv`: "What is a + b?"; a `calculate` tool (not final, no reward) and
  `submit_answer` (reward 1 right, 0 wrong; finishes the episode).
- `plainanswerenv`: the same questions, answered by a plain message: OpenReward's `@terminal`
  tool receives it (1 when its last number is right).
- `flakygraderenv`: a grader that breaks: `submit_answer` raises, `ask_grader` never returns.

Splits: "train" (operands 10..49) and "test" (operands 50..99), so no test question is a
training one.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re

from openreward.environments import (
    Environment,
    JSONObject,
    Server,
    TextBlock,
    ToolOutput,
    terminal,
    tool,
)
from pydantic import BaseModel

SPLITS = {"train": (10, 49, 16), "test": (50, 99, 8)}  # operand range, number of tasks


def make_tasks(split: str) -> list[JSONObject]:
    low, high, count = SPLITS[split]
    rng = random.Random(split)
    tasks: list[JSONObject] = []
    for index in range(count):
        a, b = rng.randint(low, high), rng.randint(low, high)
        tasks.append({"id": f"{split}-{index}", "question": f"What is {a} + {b}?", "answer": a + b})
    return tasks


class Expression(BaseModel):
    expression: str


class Answer(BaseModel):
    answer: int


class Reply(BaseModel):
    text: str


class Questions(Environment):
    """The tasks and prompt the environments below share (served only through them)."""

    def __init__(self, task_spec: JSONObject, secrets: dict[str, str] | None = None) -> None:
        super().__init__(task_spec)
        self.question = str(task_spec["question"])
        self.answer = int(task_spec["answer"])  # type: ignore[call-overload]

    @classmethod
    def list_splits(cls) -> list[str]:
        return list(SPLITS)

    @classmethod
    def list_tasks(cls, split: str) -> list[JSONObject]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}")
        return make_tasks(split)

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(text=f"{self.question} Submit the answer with submit_answer.")]


class ArithmeticEnv(Questions):
    """Add two numbers; submit the sum."""

    @tool
    async def calculate(self, params: Expression) -> ToolOutput:
        """Evaluate a sum such as "12 + 30"."""
        terms = re.fullmatch(r"\s*(-?\d+)\s*\+\s*(-?\d+)\s*", params.expression)
        if terms is None:
            return ToolOutput(blocks=[TextBlock(text="error: write it as a + b")])
        return ToolOutput(blocks=[TextBlock(text=str(int(terms[1]) + int(terms[2])))])

    @tool
    async def submit_answer(self, params: Answer) -> ToolOutput:
        """Submit the final answer. This ends the episode."""
        correct = params.answer == self.answer
        return ToolOutput(
            blocks=[TextBlock(text="Correct!" if correct else "Wrong.")],
            reward=1.0 if correct else 0.0,
            finished=True,
            metadata={"expected": self.answer},
        )


class PlainAnswerEnv(Questions):
    """The same questions, answered in plain text."""

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(text=f"{self.question} Reply with the number.")]

    @terminal
    @tool
    async def final_answer(self, params: Reply) -> ToolOutput:
        """The assistant's plain reply, graded by its last number."""
        numbers = re.findall(r"-?\d+", params.text)
        correct = bool(numbers) and int(numbers[-1]) == self.answer
        return ToolOutput(
            blocks=[TextBlock(text="Correct!" if correct else "Wrong.")],
            reward=1.0 if correct else 0.0,
            finished=True,
        )


class FlakyGraderEnv(Questions):
    """A grader that raises, and one that never answers."""

    @tool
    async def submit_answer(self, params: Answer) -> ToolOutput:
        """Submit the final answer. This ends the episode."""
        raise RuntimeError("the grader lost its answer key")

    @tool
    async def ask_grader(self, params: Answer) -> ToolOutput:
        """Ask the grader whether an answer is right."""
        await asyncio.Event().wait()  # waits for a grader that never comes
        raise AssertionError("unreachable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    Server([ArithmeticEnv, PlainAnswerEnv, FlakyGraderEnv]).run(host=args.host, port=args.port)


if __name__ == "__main__":
    main()
