"""Background work that dies is named, restarted, and reported until it runs again."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from rlnode.service.supervised import Background, Supervised

pytestmark = pytest.mark.asyncio


async def test_a_body_that_dies_is_reported_then_started_again() -> None:
    runs: list[int] = []
    release = asyncio.Event()

    async def body() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            raise RuntimeError("database is locked")
        await release.wait()

    task = Supervised("consuming t", body, first_delay_s=0.2).start()
    await asyncio.sleep(0.05)
    assert task.failure == "RuntimeError: database is locked"  # while it waits to restart
    assert task.restarts == 1 and task.running
    await asyncio.sleep(0.3)
    assert runs == [0, 1] and task.failure is None
    release.set()
    await task.wait()
    assert not task.running


async def test_backoff_doubles_to_its_ceiling() -> None:
    starts: list[float] = []
    loop = asyncio.get_running_loop()

    async def body() -> None:
        starts.append(loop.time())
        raise ValueError("again")

    task = Supervised("flaky", body, first_delay_s=0.05, max_delay_s=0.1).start()
    await asyncio.sleep(0.5)
    await task.stop()
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps[0] == pytest.approx(0.05, abs=0.04)
    assert all(gap == pytest.approx(0.1, abs=0.05) for gap in gaps[1:])
    assert not task.running


async def test_background_reports_only_what_is_down_and_forgets_what_ended() -> None:
    background = Background()
    hold = asyncio.Event()

    async def broken() -> None:
        raise OSError("disk full")

    async def fine() -> None:
        await hold.wait()

    background.run("job a", broken, first_delay_s=5.0)
    done = background.run("job b", fine)
    await asyncio.sleep(0.05)
    assert background.failures() == {"job a": "OSError: disk full"}
    with pytest.raises(RuntimeError, match="running already"):
        background.run("job b", fine)
    hold.set()
    await done.wait()
    await asyncio.sleep(0)
    assert set(background.tasks) == {"job a"}
    await background.stop()
    assert background.tasks == {} and background.failures() == {}
