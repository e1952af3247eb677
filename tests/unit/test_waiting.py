"""The tests' own waits: one that gives up says what it waited for and how far it got."""

from __future__ import annotations

import asyncio

import pytest

from rlnode.testing import waiting_for


async def test_a_wait_that_gives_up_says_what_it_waited_for_and_how_far_it_got() -> None:
    seen: list[str] = []
    with pytest.raises(AssertionError, match=r"^no reply within 0.05 s; so far: \['a'\]$"):
        async with waiting_for("reply", 0.05, lambda: seen):
            seen.append("a")
            await asyncio.sleep(5)


async def test_a_wait_that_ends_in_time_says_nothing() -> None:
    async with waiting_for("reply", 5):
        await asyncio.sleep(0)
