"""Where a job loop's records go, behind one small interface: the learner's goes to the bus;
tests and benchmarks keep everything in one process. Trajectories come back through the
runner's `offer`, whoever produces them.

    transport.publish_work(items)      a step's rollout work, in order
    transport.publish_weights(version) a new policy version (the file is written already)
    transport.publish_event(event)     anything the job's watchers should hear
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from rlnode.bus import Bus
from rlnode.messages import JobEvent, RolloutWork, WeightVersion


class JobTransport(Protocol):
    async def publish_work(self, work: Sequence[RolloutWork]) -> None: ...

    async def publish_weights(self, version: WeightVersion) -> None: ...

    async def publish_event(self, event: JobEvent) -> None: ...


class BusTransport:
    """The learner's: records go to their topics (a step's work in one go)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def publish_work(self, work: Sequence[RolloutWork]) -> None:
        await self.bus.publish_all(work)

    async def publish_weights(self, version: WeightVersion) -> None:
        await self.bus.publish(version)

    async def publish_event(self, event: JobEvent) -> None:
        await self.bus.publish(event)


class InMemoryTransport:
    """Keeps every record, in order, and hands work and weights to whoever listens (an
    `InProcessGenerator`): the job loop without a broker, in seconds."""

    def __init__(self) -> None:
        self.work: list[RolloutWork] = []
        self.weights: list[WeightVersion] = []
        self.events: list[JobEvent] = []
        self.on_work: list[Callable[[Sequence[RolloutWork]], Awaitable[None]]] = []
        self.on_weights: list[Callable[[WeightVersion], Awaitable[None]]] = []

    async def publish_work(self, work: Sequence[RolloutWork]) -> None:
        self.work.extend(work)
        for listener in self.on_work:
            await listener(work)

    async def publish_weights(self, version: WeightVersion) -> None:
        self.weights.append(version)
        for listener in self.on_weights:
            await listener(version)

    async def publish_event(self, event: JobEvent) -> None:
        self.events.append(event)
