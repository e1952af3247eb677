"""Where a job loop's records go, behind one small interface: the learner's goes to the bus;
tests and benchmarks keep everything in one process. Trajectories come back through the
runner's `offer`, whoever produces them.

    transport.publish_work(items)      a step's rollout work, in order
    transport.publish_weights(version) a new policy version (the file is written already)
    transport.publish_event(event)     anything the job's watchers should hear
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from aiokafka.errors import KafkaError
from pydantic import BaseModel

from rlnode.bus import Bus
from rlnode.bus.errors import BusUnavailable
from rlnode.messages import JobEvent, RolloutWork, WeightVersion

log = logging.getLogger("rlnode.training.transport")


class JobTransport(Protocol):
    async def publish_work(self, work: Sequence[RolloutWork]) -> None: ...

    async def publish_weights(self, version: WeightVersion) -> None: ...

    async def publish_event(self, event: JobEvent) -> None: ...


class BusTransport:
    """The learner's: records go to their topics (a step's work in one go). While the
    broker cannot be reached, a publish is tried again for up to `outage_s` (a record sent
    twice is harmless: work and trajectories are deduplicated by work id), then fails the
    job with the broker's error."""

    def __init__(self, bus: Bus, outage_s: float = 120.0) -> None:
        self.bus = bus
        self.outage_s = outage_s

    async def publish_work(self, work: Sequence[RolloutWork]) -> None:
        await self._until_published(work)

    async def publish_weights(self, version: WeightVersion) -> None:
        await self._until_published([version])

    async def publish_event(self, event: JobEvent) -> None:
        await self._until_published([event])

    async def _until_published(self, records: Sequence[BaseModel]) -> None:
        deadline = time.monotonic() + self.outage_s
        delay = 0.5
        while True:
            try:
                await self.bus.publish_all(records)
                return
            except (KafkaError, BusUnavailable) as e:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning(
                    "%s: publishing failed (%s); trying again in %.1fs", self.bus.service, e, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)


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
