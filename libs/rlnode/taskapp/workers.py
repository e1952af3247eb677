"""Episodes in child processes, for Task Apps that run someone else's code: a game engine, a
task generator or a scorer from an environment library can loop forever or hold the GIL, and
asyncio cannot interrupt either. `Isolated(build, kwargs)` names a Task App by the function
that builds its definition; the app serves the HTTP routes itself and runs each episode
(make_task, run_episode and the episode's calls to the policy) in a reusable worker process
built from the same function.

- A worker past its deadline (the rollout's `safety.max_time_s` and a few seconds' grace,
  or `task_timeout_s` for a task) is killed and replaced: that rollout fails, with a message
  that says so, and the others go on.
- What the episode raises comes back as its type and message (`EpisodeError`); a worker
  that dies (a segfault, the memory limit) as its exit status.
- Workers start on first use, up to `processes` at once; requests beyond that wait for one.

Processes are spawned, not forked: the parent runs an event loop and threads that a fork
would copy in whatever state they were in.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from rlnode.taskapp.contract import RolloutRequest, RolloutResponse
from rlnode.taskapp.inference import InferenceError

if TYPE_CHECKING:
    from rlnode.taskapp.server import TaskAppDefinition

GRACE_S = 5.0  # past the episode's own timeout, which aborts an episode that awaits


class EpisodeError(RuntimeError):
    """The episode (or the task it was built from) raised, timed out or lost its worker."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True)
class Isolated:
    """A Task App whose episodes run in worker processes. `build(**kwargs)` returns its
    `TaskAppDefinition`; it must be a module-level function (the workers import it)."""

    build: Callable[..., TaskAppDefinition]
    kwargs: dict[str, Any] = field(default_factory=dict)
    processes: int = 4
    task_timeout_s: float = 30.0

    def definition(self) -> TaskAppDefinition:
        return self.build(**self.kwargs)


def _serve_episodes(connection: Connection, isolated: Isolated) -> None:
    """A worker's loop: one request at a time, on an event loop of its own."""
    from rlnode.service.pooled_http import PooledHttp
    from rlnode.taskapp.server import policy_for, run_rollout

    definition = isolated.definition()
    loop = asyncio.new_event_loop()
    http = PooledHttp()
    while True:
        try:
            kind, payload = connection.recv()
        except (EOFError, OSError):
            break
        try:
            if kind == "task":
                seed, config = payload
                result: Any = definition.make_task(seed, config)
            else:
                request = RolloutRequest.model_validate_json(payload)
                policy = policy_for(request, http)
                response = loop.run_until_complete(run_rollout(definition, request, policy))
                result = response.model_dump_json()
            connection.send(("ok", result))
        except InferenceError as e:  # the policy's failure, not the episode's
            connection.send(("inference", str(e)))
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            connection.send(
                ("error", f"{type(e).__name__}: {e} (at {where.filename}:{where.lineno})")
            )
    loop.run_until_complete(http.aclose())


class _Worker:
    def __init__(self, isolated: Isolated) -> None:
        context = multiprocessing.get_context("spawn")
        self.connection, child_end = context.Pipe()
        self.process: BaseProcess = context.Process(
            target=_serve_episodes, args=(child_end, isolated), daemon=True
        )
        self.process.start()
        child_end.close()

    async def call(self, kind: str, payload: Any, timeout_s: float) -> Any:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[None] = loop.create_future()
        fd = self.connection.fileno()

        def readable() -> None:
            if not reply.done():
                reply.set_result(None)

        loop.add_reader(fd, readable)
        try:
            self.connection.send((kind, payload))
            await asyncio.wait_for(reply, timeout_s)
            status, result = self.connection.recv()
        finally:
            loop.remove_reader(fd)
        if status == "error":
            raise EpisodeError(f"the episode raised {result}")
        if status == "inference":
            raise InferenceError(result)
        return result

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.connection.close()

    def exit_status(self) -> str:
        self.process.join(1)
        code = self.process.exitcode
        return f"exit status {code}" if code is not None and code >= 0 else f"signal {-(code or 0)}"


class EpisodeWorkers:
    """The pool of worker processes of one `Isolated` Task App."""

    def __init__(self, isolated: Isolated) -> None:
        if isolated.processes < 1:
            raise ValueError("an isolated Task App needs at least 1 process")
        self.isolated = isolated
        self._idle: list[_Worker] = []
        self._slots = asyncio.Semaphore(isolated.processes)
        self.replaced = 0  # workers killed for a deadline or lost

    async def make_task(self, seed: int, config: dict[str, Any]) -> dict[str, Any]:
        result = await self._call(
            "task", (seed, config), self.isolated.task_timeout_s, f"the task for seed {seed}"
        )
        return dict(result)

    async def rollout(self, request: RolloutRequest) -> RolloutResponse:
        timeout_s = request.safety.max_time_s + GRACE_S
        result = await self._call(
            "rollout",
            request.model_dump_json(),
            timeout_s,
            f"the episode of seed {request.env.seed}",
        )
        return RolloutResponse.model_validate_json(result)

    async def _call(self, kind: str, payload: Any, timeout_s: float, what: str) -> Any:
        async with self._slots:
            worker = self._idle.pop() if self._idle else _Worker(self.isolated)
            started = time.monotonic()
            try:
                result = await worker.call(kind, payload, timeout_s)
            except TimeoutError:
                worker.kill()
                self.replaced += 1
                raise EpisodeError(
                    f"{what} did not finish in {time.monotonic() - started:.0f}s: its worker "
                    "process was killed and replaced",
                    timed_out=True,
                ) from None
            except (EOFError, OSError, BrokenPipeError):
                status = worker.exit_status()
                worker.kill()
                self.replaced += 1
                raise EpisodeError(f"the worker running {what} died ({status})") from None
            except (EpisodeError, InferenceError):
                self._idle.append(worker)
                raise
            except BaseException:  # cancelled mid-call: the worker's state is unknown
                worker.kill()
                raise
            self._idle.append(worker)
            return result

    def close(self) -> None:
        for worker in self._idle:
            worker.kill()
        self._idle.clear()
