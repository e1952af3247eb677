"""A service's stacks in its log on SIGUSR1: what a process that will not stop is waiting on.

A supervisor sends SIGUSR1 to a service that outlived its SIGTERM grace, just before the
SIGKILL (processes.py): every thread's stack (faulthandler, which writes even when the event
loop is stuck in C) and every asyncio task's (where the loop still runs Python) go to
stderr, which is the service's log."""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import sys
from types import FrameType

DUMP_SIGNAL = signal.SIGUSR1


def awaiting(task: asyncio.Task) -> list[str]:
    """Where a task waits, outermost first: each coroutine's frame down the `await` chain
    (Task.print_stack shows only the outermost), then what the innermost awaits: a gather's
    children, a future, a task."""
    lines: list[str] = []
    awaited: object = task.get_coro()
    for _ in range(64):  # a chain that long is a bug of its own; stop, don't loop
        frame = _frame(awaited)
        if frame is None:
            break
        lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        awaited = _awaited_by(awaited, frame)
    if isinstance(awaited, asyncio.Future):
        children = getattr(awaited, "_children", None)  # gather's, private but stable
        lines.append(f"  awaiting {awaited!r}"[:400])
        for child in children or ():
            lines.append(f"    child {child!r}"[:400])
    return lines


def _frame(awaitable: object) -> FrameType | None:
    for name in ("cr_frame", "gi_frame", "ag_frame"):  # coroutine, generator, async generator
        frame = getattr(awaitable, name, None)
        if frame is not None:
            return frame
    return None


def _awaited_by(awaitable: object, frame: FrameType) -> object:
    """What `awaitable` (running `frame`) awaits. An async generator's asend/athrow (an
    `async with` on an @asynccontextmanager: a lifespan's shutdown) names no frame: go on in
    the generator it drives, the context manager's `gen`."""
    for name in ("cr_await", "gi_yieldfrom", "ag_await"):
        awaited = getattr(awaitable, name, None)
        if awaited is not None:
            break
    if awaited is not None and _frame(awaited) is None and not isinstance(awaited, asyncio.Future):
        generator = getattr(frame.f_locals.get("self"), "gen", None)
        if _frame(generator) is not None:
            return generator
    return awaited


def dump_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    print(f"--- {len(tasks)} asyncio tasks ---", file=sys.stderr)
    for task in tasks:
        print(f"task {task.get_name()}:", file=sys.stderr)
        print("\n".join(awaiting(task)), file=sys.stderr)
    sys.stderr.flush()


def install_stack_dump() -> None:
    """On DUMP_SIGNAL: the threads' stacks at once, the tasks' once the loop runs Python."""

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.call_soon_threadsafe(dump_tasks, loop)

    signal.signal(DUMP_SIGNAL, on_signal)
    # chain: faulthandler's C handler runs first, then the Python handler above.
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=True)
