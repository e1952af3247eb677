"""A multi-turn verifiers 0.4 environment (the `verifiers.v1` API): a taskset with its own Env
that plays the user, as TextArena's taskset in verifiers does, for rlnode's verifiers adapter
tests (tests/integration/test_env_verifiers.py). Run it with the verifiers-0.4 venv's python;
it imports nothing of rlnode's.

The model is asked "What is a + b?", then, as a second user turn, "Now add c."; each answer
inside <answer>...</answer>. Rewards: `first_answer` and `second_answer`, 1 each when right.
`split` "train" has operands 10..49, "test" 50..99.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Literal

import verifiers.v1 as vf

SPLITS = {"train": (10, 49, 4), "test": (50, 99, 2)}
ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def answered(reply: str, expected: int) -> float:
    given = ANSWER.findall(reply)
    return 1.0 if given and given[-1] == str(expected) else 0.0


class FollowupConfig(vf.TasksetConfig):
    split: Literal["train", "test"] = "train"


class FollowupData(vf.TaskData):
    a: int
    b: int
    c: int


class FollowupTask(vf.Task[FollowupData, vf.State, vf.TaskConfig]):
    pass


class FollowupEnvConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()


class FollowupEnv(vf.Env[FollowupEnvConfig]):
    async def run(self, task, agents):
        data = task.data
        async with agents.solver.interaction(task) as interaction:
            first = await interaction.turn()
            second = await interaction.turn(f"Now add {data.c}.")
        trace = interaction.trace
        trace.record_reward("first_answer", answered(first.last_reply, data.a + data.b), 1.0)
        total = data.a + data.b + data.c
        trace.record_reward("second_answer", answered(second.last_reply, total), 1.0)


class FollowupTaskset(vf.Taskset[FollowupTask, FollowupConfig]):
    def load(self) -> Iterator[FollowupTask]:
        low, high, count = SPLITS[self.config.split]
        rng = random.Random(self.config.split)
        for index in range(count):
            a, b, c = (rng.randint(low, high) for _ in range(3))
            yield FollowupTask(
                FollowupData(
                    id=f"{self.config.split}-{index}",
                    prompt=f"What is {a} + {b}?",
                    system_prompt="Answer inside <answer>...</answer>.",
                    a=a,
                    b=b,
                    c=c,
                ),
                self.config.task,
            )


__all__ = ["FollowupEnv", "FollowupTaskset"]
