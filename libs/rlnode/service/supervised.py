"""Background work that must not die unnoticed. A `Supervised` task runs its body until the
body returns; if the body raises, the cause goes to the log and to `failure` (a service's
/health answers 503 naming it, see `create_service_app`) and the body is started again after
a backoff. `Background` holds a service's supervised tasks and reports their failures."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("rlnode.service.supervised")

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 30.0


class Supervised:
    def __init__(
        self,
        name: str,
        body: Callable[[], Awaitable[None]],
        *,
        first_delay_s: float = FIRST_DELAY_S,
        max_delay_s: float = MAX_DELAY_S,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.body = body
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.on_done = on_done
        self.failure: str | None = None  # why the body died, while it waits to start again
        self.restarts = 0
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> Supervised:
        if not self.running:
            self._stopping = False
            self._task = asyncio.create_task(self._supervise(), name=self.name)
        return self

    async def stop(self) -> None:
        """Cancel the body (or the wait before its restart) and wait until it is gone."""
        self._stopping = True
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            # Again until it ends: a body may swallow one cancel (asyncio.wait_for on 3.11).
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def wait(self) -> None:
        """Until the body returns (or the task is stopped)."""
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._task)

    async def _supervise(self) -> None:
        delay = self.first_delay_s
        try:
            while not self._stopping:
                try:
                    await self.body()
                    return
                except Exception as e:
                    self.failure = f"{type(e).__name__}: {e}"
                    self.restarts += 1
                    log.exception("%s died; starting it again in %.1fs", self.name, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.max_delay_s)
                    self.failure = None
        finally:
            if self.on_done is not None:
                self.on_done()


class Background:
    """A service's supervised tasks by name; `failures` is what its /health reports."""

    def __init__(self) -> None:
        self.tasks: dict[str, Supervised] = {}

    def run(self, name: str, body: Callable[[], Awaitable[None]], **options: float) -> Supervised:
        """Start `body` supervised under `name` (a task of that name that still runs is
        replaced only once it has ended); it leaves the registry when it returns."""
        if name in self.tasks and self.tasks[name].running:
            raise RuntimeError(f"{name} is running already")
        task = Supervised(name, body, on_done=lambda: self._forget(name, task), **options)
        self.tasks[name] = task
        return task.start()

    def _forget(self, name: str, task: Supervised) -> None:
        if self.tasks.get(name) is task:
            del self.tasks[name]

    def failures(self) -> dict[str, str]:
        return {name: t.failure for name, t in self.tasks.items() if t.failure is not None}

    async def stop(self) -> None:
        await asyncio.gather(*(t.stop() for t in list(self.tasks.values())))
        self.tasks.clear()
