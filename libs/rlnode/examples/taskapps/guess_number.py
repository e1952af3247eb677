"""Guess-a-number: a multi-turn task. The policy guesses a secret number between 1 and
`high`; after each guess it is told "higher" or "lower", for up to `max_turns` turns.
Reward: 1 for finding it in one guess, less for each extra guess, 0 if it never does.

    ENVIRONMENT_API_KEY=... PORT=8102 python -m rlnode.examples.taskapps.guess_number

env config: {"high": 100, "max_turns": 8}
"""

from __future__ import annotations

import random
import re
import sys
from typing import Any

from rlnode.taskapp import Episode, TaskAppDefinition, serve

NUMBER = re.compile(r"-?\d+")


def make_task(seed: int, config: dict[str, Any]) -> dict[str, Any]:
    high = int(config.get("high", 100))
    max_turns = int(config.get("max_turns", 8))
    return {"secret": random.Random(seed).randint(1, high), "high": high, "max_turns": max_turns}


async def run_episode(task: dict[str, Any], episode: Episode) -> None:
    messages: list[dict[str, Any]] = [
        {
            "role": "system",
            "content": f"Guess my number between 1 and {task['high']}. Answer with the number only.",
        },
        {"role": "user", "content": "Your first guess?"},
    ]
    for turn in range(1, task["max_turns"] + 1):
        answer = await episode.chat(messages)
        messages.append({"role": "assistant", "content": answer.text})
        found = NUMBER.findall(answer.text)
        observation = {"turn": turn, "last_feedback": messages[-2]["content"]}
        if not found:
            feedback = "That is not a number. Answer with the number only."
        else:
            guess = int(found[-1])
            if guess == task["secret"]:
                score = 1.0 - (turn - 1) / task["max_turns"]
                episode.step(
                    observation,
                    answer.text,
                    score,
                    done=True,
                    info={"guess": guess, "solved": True},
                )
                return
            feedback = "higher" if guess < task["secret"] else "lower"
        last = turn == task["max_turns"]
        episode.step(
            observation, answer.text, 0.0, done=last, info={"feedback": feedback, "solved": False}
        )
        messages.append({"role": "user", "content": feedback})


DEFINITION = TaskAppDefinition(
    name="guess-number",
    description="Find a secret number with higher/lower feedback, in as few guesses as possible.",
    make_task=make_task,
    run_episode=run_episode,
    dataset={"seeds": "any integer", "config": {"high": 100, "max_turns": 8}},
    rubric={"outcome": "1 - (guesses - 1) / max_turns when found, else 0"},
    limits={"max_turns": 8},
)

if __name__ == "__main__":
    sys.exit(serve(DEFINITION))
