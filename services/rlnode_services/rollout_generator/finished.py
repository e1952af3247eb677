"""Jobs that have ended (completed, failed, cancelled), followed on the job-events topic, so
that work still queued for them is skipped rather than run: a cancelled job frees the
generators at once, and a generator that joins late does not replay dead jobs' work."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import TopicPartition

from rlnode.bus import Bus
from rlnode.messages import JobEvent, JobEventType, topics
from rlnode.messages.codec import DecodeError, decode

log = logging.getLogger("rollout_generator.finished")

ENDED = {JobEventType.COMPLETED, JobEventType.FAILED, JobEventType.CANCELLED}


class FinishedJobs:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.ids: set[str] = set()
        self.caught_up = asyncio.Event()
        self.skipped = 0
        self._task: asyncio.Task | None = None
        self._consumer = None

    def __contains__(self, job_id: str) -> bool:
        return job_id in self.ids

    async def start(self) -> None:
        self._consumer = self.bus.consumer(group_id=None)
        await self._consumer.start()
        self._task = asyncio.create_task(self._follow(), name="finished-jobs")

    async def wait_caught_up(self, timeout_s: float) -> None:
        """Until the events that existed at start are read (so old jobs are known)."""
        try:
            await asyncio.wait_for(self.caught_up.wait(), timeout_s)
        except TimeoutError:
            log.warning("job-events not read to the end within %.0fs; going on", timeout_s)

    async def _follow(self) -> None:
        consumer = self._consumer
        partitions = [
            TopicPartition(topics.JOB_EVENTS, p)
            for p in sorted(consumer.partitions_for_topic(topics.JOB_EVENTS) or [])
        ]
        if not partitions:
            await consumer._client.force_metadata_update()
            partitions = [
                TopicPartition(topics.JOB_EVENTS, p)
                for p in sorted(consumer.partitions_for_topic(topics.JOB_EVENTS) or [])
            ]
        if not partitions:  # no events yet: nothing ended
            self.caught_up.set()
            consumer.subscribe([topics.JOB_EVENTS])
        else:
            consumer.assign(partitions)
            await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions) if partitions else {}
        while True:
            batches = await consumer.getmany(timeout_ms=500, max_records=1000)
            for records in batches.values():
                for record in records:
                    try:
                        event = decode(record.value, JobEvent)
                    except DecodeError:
                        continue
                    if event.type in ENDED:
                        self.ids.add(event.job_id)
            if not self.caught_up.is_set() and all(
                [await consumer.position(tp) >= end for tp, end in ends.items()]
            ):
                self.caught_up.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()
