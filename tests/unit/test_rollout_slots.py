"""The generator's rollout slots: a work item's samples take theirs together."""

from __future__ import annotations

import asyncio

from rlnode_services.rollout_generator.rollouts import RolloutSlots


async def settle() -> None:
    """Let every task that can run, run (no clock: the loop's turns)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def test_an_item_waits_until_all_its_slots_are_free_and_never_holds_part() -> None:
    slots = RolloutSlots(4)
    order: list[str] = []
    first_done = asyncio.Event()

    async def item(name: str, count: int, hold: asyncio.Event | None = None) -> None:
        async with slots.take(count):
            order.append(f"{name} in ({slots.free} free)")
            if hold is not None:
                await hold.wait()
        order.append(f"{name} out")

    a = asyncio.create_task(item("a", 3, first_done))
    await settle()
    b = asyncio.create_task(item("b", 3))  # needs 3 of the 1 left: waits, holding none
    c = asyncio.create_task(item("c", 1))  # fits beside a at once
    await settle()
    assert order == ["a in (1 free)", "c in (0 free)", "c out"] and slots.free == 1
    first_done.set()
    await asyncio.gather(a, b, c)
    assert order[3:] == ["a out", "b in (1 free)", "b out"] and slots.free == 4
