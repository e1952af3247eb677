"""A Task App whose episodes misbehave on request (env config "behaviour"), for the worker
processes' tests: it stands in for an environment library's code, not for rlnode's."""

from __future__ import annotations

import os
import time
from typing import Any

from rlnode.taskapp import Episode, TaskAppDefinition


def make_task(seed: int, config: dict[str, Any]) -> dict[str, Any]:
    behaviour = config.get("behaviour", "answer")
    if behaviour == "hang-making-task":
        while True:  # a generator that never returns, holding the GIL
            pass
    return {"behaviour": behaviour, "word": f"w{seed}"}


async def run_episode(task: dict[str, Any], episode: Episode) -> None:
    answer = await episode.chat([{"role": "user", "content": f"Copy: {task['word']}"}])
    match task["behaviour"]:
        case "hang":
            while True:  # a scorer that never returns: asyncio cannot interrupt it
                pass
        case "raise":
            raise ValueError(f"cannot score {answer.text!r}")
        case "die":
            os._exit(3)
        case "sleep":
            started = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process
            # Long enough to overlap on a loaded machine (0.5 s did not, beside another worker).
            time.sleep(3)  # noqa: ASYNC251 - blocking on purpose: the worker is its own process
            info = {"pid": os.getpid(), "ran": [started, time.monotonic()]}
            episode.step({}, answer.text, 1.0, done=True, info=info)
            return
    episode.step({}, answer.text, float(answer.text == task["word"]), done=True)


def build(name: str = "isolated") -> TaskAppDefinition:
    return TaskAppDefinition(name=name, make_task=make_task, run_episode=run_episode)
