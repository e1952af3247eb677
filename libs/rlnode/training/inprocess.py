"""The rollout-generator's work in one process, for the job loop without a node: each work
item's episode is played by the Task App's own code (`TaskAppDefinition.run_episode`, as its
`/rollout` route plays it), its policy calls are sampled from an engine and recorded turn by
turn (`sample_turn`, as the generator's inference endpoints do), and the trajectory goes to
the job's runner. Weight versions are checked and loaded into the engine as they come, and
work waits for the version it was issued at, as on a generator.

No Kafka, no HTTP, no Task App process: the benchmarks' in-process baseline and the job
loop's fast tests."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from rlnode.engine import Engine, render_chat
from rlnode.engine.turns import sample_turn
from rlnode.messages import RolloutFailure, RolloutWork, TokenTurn, Trajectory, WeightVersion
from rlnode.service.openai_api import (
    ChatCompletionRequest,
    assistant_message,
    stops,
    text_content,
)
from rlnode.taskapp.bridge import rollout_request, trajectory
from rlnode.taskapp.contract import NormalisedRollout
from rlnode.taskapp.inference import ChatResult
from rlnode.taskapp.server import TaskAppDefinition, run_rollout
from rlnode.training.transport import InMemoryTransport

log = logging.getLogger("rlnode.training.inprocess")


class _RecordingPolicy:
    """What an episode's `chat` reaches: the engine, with every turn recorded."""

    def __init__(self, engine: Engine, work: RolloutWork) -> None:
        self.engine = engine
        self.work = work
        self.turns: list[TokenTurn] = []

    @property
    def calls(self) -> int:
        return len(self.turns)

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> ChatResult:
        # The same request model, rendering and tool-call parsing as the generator's
        # per-rollout endpoint.
        request = ChatCompletionRequest(
            messages=messages, tools=sampling.get("tools"), tool_choice=sampling.get("tool_choice")
        )
        tools = request.template_tools()
        prompt_ids = render_chat(
            self.engine.tokenizer, [text_content(m) for m in request.messages], tools
        )
        turn, text = await sample_turn(
            self.engine,
            prompt_ids,
            self.work.sampling,
            self.work.model.max_seq_len,
            sampling.get("max_tokens"),
            stops(sampling.get("stop")),
        )
        self.turns.append(turn)
        message, finish = assistant_message(text, turn.finish_reason, tools is not None)
        return ChatResult(
            text=message["content"] or "",
            finish_reason=finish,
            raw={"choices": [{"message": message, "finish_reason": finish}]},
            tool_calls=message.get("tool_calls", []),
        )


class InProcessGenerator:
    def __init__(
        self,
        engine: Engine,
        task_app: TaskAppDefinition,
        deliver: Callable[[Trajectory], None],
        name: str = "in-process",
    ) -> None:
        """`deliver` takes each trajectory (a runner's `offer`)."""
        self.engine = engine
        self.task_app = task_app
        self.deliver = deliver
        self.name = name
        self.loaded_version = 0
        self.rollouts = 0
        self._loaded = asyncio.Condition()
        self._tasks: set[asyncio.Task] = set()

    def attach(self, transport: InMemoryTransport) -> InProcessGenerator:
        """Take the work and weights a job loop publishes on `transport`."""
        transport.on_work.append(self.on_work)
        transport.on_weights.append(self.on_weights)
        return self

    async def on_work(self, work: Sequence[RolloutWork]) -> None:
        for item in work:
            for sample in item.sample_indices:
                task = asyncio.create_task(self._run(item, sample))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def on_weights(self, version: WeightVersion) -> None:
        await self.engine.load_weights(
            version.path, version.version, version.blake3, adapter=version.adapter
        )
        async with self._loaded:
            self.loaded_version = max(self.loaded_version, version.version)
            self._loaded.notify_all()

    async def _run(self, work: RolloutWork, sample: int) -> None:
        # Never sample work from a policy older than the one it was issued at.
        async with self._loaded:
            await self._loaded.wait_for(lambda: self.loaded_version >= work.policy_version)
        self.deliver(await self.rollout(work, sample))

    async def rollout(self, work: RolloutWork, sample: int) -> Trajectory:
        """Sample `sample` of `work`: always a trajectory, ok or failed with the reason."""
        started = time.monotonic()
        rollout_id = secrets.token_urlsafe(12)
        policy = _RecordingPolicy(self.engine, work)
        request = rollout_request(work, rollout_id, f"in-process://{self.name}/{rollout_id}")
        try:
            response = await run_rollout(self.task_app, request, policy)
            outcome = NormalisedRollout.from_response(response)
        except Exception as e:
            failure = RolloutFailure(kind="task_app_error", message=f"{type(e).__name__}: {e}")
            return trajectory(
                work, sample, rollout_id, self.name, started, policy.turns, failure=failure
            )
        self.rollouts += 1
        return trajectory(work, sample, rollout_id, self.name, started, policy.turns, outcome)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
