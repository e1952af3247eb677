"""Consuming rollout work with many rollouts in flight, committing offsets only for work
whose trajectory was published.

Kafka commits a position per partition, so a partition's offset advances only over a
contiguous run of finished records; a record still in flight holds back the ones after it.
What is not committed when a generator dies is delivered again to another one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from rlnode.bus import Bus, RecordTooLarge
from rlnode.messages import JobEvent, JobEventType, RolloutFailure, RolloutWork, Trajectory, topics
from rlnode_services.rollout_generator.finished import FinishedJobs

log = logging.getLogger("rollout_generator.work")


class OffsetTracker:
    """Per partition: offsets handed out, and which of them are done."""

    def __init__(self) -> None:
        self._pending: dict[TopicPartition, dict[int, bool]] = {}

    def start(self, partition: TopicPartition, offset: int) -> None:
        self._pending.setdefault(partition, {})[offset] = False

    def finish(self, partition: TopicPartition, offset: int) -> None:
        if offset in self._pending.get(partition, {}):
            self._pending[partition][offset] = True

    def committable(self) -> dict[TopicPartition, int]:
        """The next offset to commit per partition (one past the contiguous finished run),
        forgetting what it covers."""
        result = {}
        for partition, offsets in self._pending.items():
            last = None
            for offset in sorted(offsets):
                if not offsets[offset]:
                    break
                last = offset
            if last is not None:
                for offset in [o for o in offsets if o <= last]:
                    del offsets[offset]
                result[partition] = last + 1
        return result

    def forget(self, partitions: set[TopicPartition]) -> None:
        for partition in partitions:
            self._pending.pop(partition, None)

    @property
    def in_flight(self) -> int:
        return sum(1 for offsets in self._pending.values() for done in offsets.values() if not done)


class WorkConsumer:
    def __init__(
        self,
        bus: Bus,
        group_id: str,
        concurrency: int,
        run_rollout: Callable[[RolloutWork], Awaitable[Trajectory]],
        max_poll_interval_ms: int,
        finished: FinishedJobs | None = None,
    ) -> None:
        self.finished = finished
        self.bus = bus
        self.group_id = group_id
        self.concurrency = concurrency
        self.run_rollout = run_rollout
        self.tracker = OffsetTracker()
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()
        self._max_poll_interval_ms = max_poll_interval_ms
        self._consumer = None  # aiokafka wants the running loop: made in start()
        self._loop_task: asyncio.Task | None = None
        self.published = 0

    async def start(self) -> None:
        self._consumer = self.bus.consumer(
            group_id=self.group_id, max_poll_interval_ms=self._max_poll_interval_ms
        )
        tracker, consumer = self.tracker, self._consumer
        owner = self

        class _Listener(ConsumerRebalanceListener):
            async def on_partitions_revoked(self, revoked):  # type: ignore[override]
                await owner._commit()
                tracker.forget(set(revoked))

            async def on_partitions_assigned(self, assigned):  # type: ignore[override]
                pass

        consumer.subscribe([topics.ROLLOUT_WORK], listener=_Listener())
        await consumer.start()
        self._loop_task = asyncio.create_task(self._loop(), name="rollout-work-consumer")

    async def _loop(self) -> None:
        if self.finished is not None:  # know which jobs ended before taking their work
            await self.finished.wait_caught_up(30.0)
        while not self._stopping.is_set():
            await self._slots.acquire()
            self._slots.release()
            batches = await self._consumer.getmany(timeout_ms=200, max_records=self.concurrency)
            for partition, records in batches.items():
                for record in records:
                    await self._slots.acquire()
                    self.tracker.start(partition, record.offset)
                    task = asyncio.create_task(self._process(partition, record))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            await self._commit()

    @property
    def partitions(self) -> list[int]:
        """The work partitions this generator holds now."""
        if self._consumer is None:
            return []
        return sorted(tp.partition for tp in self._consumer.assignment())

    async def _process(self, partition: TopicPartition, record) -> None:
        try:
            work = await self.bus.accept(record, RolloutWork, group_id=self.group_id)
            if work is not None and self.finished is not None and work.job_id in self.finished:
                self.finished.skipped += 1  # the job ended: nobody waits for this rollout
            elif work is not None:
                trajectory = await self.run_rollout(work)
                await self._publish(trajectory)
            self.tracker.finish(partition, record.offset)
        except asyncio.CancelledError:
            log.info(
                "rollout at %s/%s left uncommitted for another generator",
                partition.partition,
                record.offset,
            )
            raise
        except Exception:
            # Leave it uncommitted: a generator that cannot publish must not drop the work.
            log.exception(
                "rollout at %s/%s failed; left uncommitted", partition.partition, record.offset
            )
        finally:
            self._slots.release()

    async def _publish(self, trajectory: Trajectory) -> None:
        delay = 0.5
        while True:
            try:
                await self.bus.publish(trajectory)
                self.published += 1
                return
            except RecordTooLarge as e:
                # Reported, and replaced by a failed trajectory so the learner counts it.
                await self.bus.publish(
                    JobEvent(
                        job_id=trajectory.job_id,
                        org_id=trajectory.org_id,
                        type=JobEventType.TRAJECTORY_TOO_LARGE,
                        source=f"rollout-generator/{trajectory.generator}",
                        message=str(e),
                        data={
                            "rollout_id": trajectory.rollout_id,
                            "size_bytes": e.size,
                            "limit_bytes": e.limit,
                        },
                    )
                )
                trajectory = trajectory.model_copy(
                    update={
                        "status": "failed",
                        "turns": [],
                        "reward": None,
                        "step_rewards": [],
                        "failure": RolloutFailure(kind="internal", message=str(e)),
                    }
                )
            except Exception as e:
                if self._stopping.is_set():
                    raise
                log.warning(
                    "could not publish trajectory %s (%s); retrying in %.1fs",
                    trajectory.rollout_id,
                    e,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _commit(self) -> None:
        offsets = self.tracker.committable()
        if offsets:
            await self._consumer.commit(
                {tp: OffsetAndMetadata(offset, "") for tp, offset in offsets.items()}
            )

    async def stop(self, drain_timeout_s: float) -> None:
        """Stop taking work; let in-flight rollouts finish for up to `drain_timeout_s`;
        commit what finished; what did not stays uncommitted for another generator."""
        self._stopping.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._tasks:
            _done, pending = await asyncio.wait(set(self._tasks), timeout=drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await self._commit()
            await self._consumer.stop()
