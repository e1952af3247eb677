"""A verifiers 0.4 taskset (the `verifiers.v1` API: Taskset, Task, @vf.reward), written as
its packages are published (a module exporting its Taskset via `__all__`), for rlnode's
verifiers adapter tests (tests/integration/test_env_verifiers.py). Run it with the
verifiers-0.4 venv's python (`make environments`); it imports nothing of rlnode's.

"What is a + b?", answered inside <answer>...</answer>. Rewards: `correct_answer`
(weight 1) and `formatted` (weight 0.2). `split` "train" has operands 10..49, "test"
50..99, so no test question is a training one. `task.grader` picks a broken grader for the
tests: "raises" (the reward raises), "hangs" (it awaits forever).
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf

SPLITS = {"train": (10, 49, 4), "test": (50, 99, 2)}  # operands, number of tasks
ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


class SumsTaskConfig(vf.TaskConfig):
    grader: Literal["exact", "raises", "hangs"] = "exact"


class SumsConfig(vf.TasksetConfig):
    split: Literal["train", "test"] = "train"
    task: SumsTaskConfig = SumsTaskConfig()


class SumsData(vf.TaskData):
    answer: int


class SumsTask(vf.Task[SumsData, vf.State, SumsTaskConfig]):
    @vf.reward(weight=1.0)
    async def correct_answer(self, trace) -> float:
        if self.config.grader == "raises":
            raise RuntimeError("the grader lost its answer key")
        if self.config.grader == "hangs":  # waits on a grading service that never answers
            await asyncio.Event().wait()
        given = ANSWER.findall(trace.last_reply)
        return 1.0 if given and given[-1] == str(self.data.answer) else 0.0

    @vf.reward(weight=0.2)
    async def formatted(self, trace) -> float:
        return 1.0 if ANSWER.search(trace.last_reply) else 0.0


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self) -> Iterator[SumsTask]:
        low, high, count = SPLITS[self.config.split]
        operands = range(low, high + 1)
        pairs = random.Random(self.config.split).sample(
            [(a, b) for a in operands for b in operands], count
        )
        for index, (a, b) in enumerate(pairs):
            yield SumsTask(
                SumsData(
                    id=f"{self.config.split}-{index}",
                    prompt=f"What is {a} + {b}?",
                    system_prompt="Answer inside <answer>...</answer>.",
                    answer=a + b,
                ),
                self.config.task,
            )


__all__ = ["SumsTaskset"]
