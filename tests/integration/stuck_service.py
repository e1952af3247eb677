"""A stand-in service for the process tests: it ignores SIGTERM and waits in a function
whose name its stack dump must show (a service stuck in its shutdown)."""

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator

from rlnode.service.stacks import install_stack_dump


async def waiting_on_something_that_never_comes() -> None:
    await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def lifespan() -> AsyncIterator[None]:
    yield
    await waiting_on_something_that_never_comes()  # its shutdown half never ends


async def shutting_down() -> None:
    # Nested, and in an @asynccontextmanager's exit (a lifespan's shutdown): Task.print_stack
    # shows only the outermost coroutine; the dump walks the chain into the generator.
    async with lifespan():
        pass


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    install_stack_dump()
    print("ready", flush=True)
    asyncio.run(shutting_down())
