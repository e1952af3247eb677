"""Reading a topic without a consumer group: every partition (or the one a job's records
land on) from the beginning (or from now), until caught up with what the topic held at the
start, then following. For watchers (`rlnode job watch`), and for services that must see
every record of a topic rather than a share of it (a generator following weight versions
and ended jobs)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from rlnode.bus import clients
from rlnode.bus.settings import KafkaSettings


class TopicReader:
    def __init__(
        self,
        settings: KafkaSettings,
        topic: str,
        *,
        service: str,
        key: str | None = None,
        from_beginning: bool = True,
        since: float | None = None,
        topic_wait_s: float = 10.0,
        **consumer_options: Any,
    ) -> None:
        """`key`: read only the partition that records keyed by it land on (a job id).
        `since` (epoch seconds): start at the first record stored at or after it rather than
        at the beginning, so that what it costs does not grow with the topic's history.
        `consumer_options`: the consumer's own (fetch_max_wait_ms for a reader on the
        rollout path)."""
        self.settings = settings
        self.topic = topic
        self.service = service
        self.key = key
        self.from_beginning = from_beginning
        self.since = since
        self.topic_wait_s = topic_wait_s
        self.consumer_options = consumer_options
        # Set once every record that existed at the start has been read.
        self.caught_up = asyncio.Event()
        self._consumer: AIOKafkaConsumer | None = None
        self._ends: dict[TopicPartition, int] = {}

    @property
    def consumer(self) -> AIOKafkaConsumer | None:
        """The consumer it reads with (to seek back to records it must read again)."""
        return self._consumer

    @property
    def partitions(self) -> list[int]:
        return sorted(tp.partition for tp in self._ends)

    async def start(self) -> None:
        numbers = await clients.topic_partitions(self.settings, self.topic, self.topic_wait_s)
        if self.key is not None:
            numbers = [clients.partition_for(self.key, numbers)]
        partitions = [TopicPartition(self.topic, n) for n in numbers]
        consumer = clients.consumer(
            self.settings, self.service, group_id=None, **self.consumer_options
        )
        # Cancelled (an event stream's client went away) or failed: closed.
        await clients.start_client(consumer.start(), consumer.stop, self.settings)
        self._consumer = consumer
        try:
            consumer.assign(partitions)
            if self.since is not None:
                await self._seek_to_time(consumer, partitions, self.since)
            elif self.from_beginning:
                await consumer.seek_to_beginning(*partitions)
            else:
                await consumer.seek_to_end(*partitions)
            self._ends = await consumer.end_offsets(partitions)
            await self._check_caught_up()
        except BaseException:  # `async with` exits only what it entered
            await self.stop()
            raise

    @staticmethod
    async def _seek_to_time(
        consumer: AIOKafkaConsumer, partitions: list[TopicPartition], since: float
    ) -> None:
        # The ends first: when nothing is stored since then, a record that arrives after the
        # time lookup (a job's verdict, published as its watcher starts) is at or past them.
        # Seeking to the end afterwards would skip it.
        ends = await consumer.end_offsets(partitions)
        found = await consumer.offsets_for_times({p: int(since * 1000) for p in partitions})
        for partition in partitions:
            hit = found.get(partition)
            # Nothing stored since then: Kafka answers none, Tansu 0.6 offset 0 without a
            # timestamp.
            if hit is None or hit.timestamp < 0:
                consumer.seek(partition, ends[partition])
            else:
                consumer.seek(partition, hit.offset)

    async def fetch(self, timeout_ms: int = 500, max_records: int = 500) -> list[ConsumerRecord]:
        """The next records in partition order (empty after `timeout_ms` without any)."""
        assert self._consumer is not None, "start() first"
        batches = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        records = [record for batch in batches.values() for record in batch]
        await self._check_caught_up()
        return records

    async def _check_caught_up(self) -> None:
        if self.caught_up.is_set() or self._consumer is None:
            return
        for partition, end in self._ends.items():
            if await self._consumer.position(partition) < end:
                return
        self.caught_up.set()

    async def stop(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(Exception):
                await consumer.stop()

    async def __aenter__(self) -> TopicReader:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()


class RecentIds:
    """The ids of the last `size` records read, to read each record once. Delivery is at
    least once: a producer that tries a publish again through a broker outage (the learner's
    does) sends the same record, id and all, a second time when the first try was stored but
    not acknowledged; the copy lands right after it in the same partition."""

    def __init__(self, size: int = 65_536) -> None:
        self.size = size
        self._ids: OrderedDict[Hashable, None] = OrderedDict()

    def first_time(self, record_id: Hashable) -> bool:
        """True the first time `record_id` is seen (within the last `size`), then False."""
        if record_id in self._ids:
            return False
        self._ids[record_id] = None
        if len(self._ids) > self.size:
            self._ids.popitem(last=False)
        return True
