"""The one way rlnode consumes a topic: decode each record into its model, validate it,
call a small typed handler, dead-letter what cannot be used, bound the records in flight,
and commit only what is settled (the offset ledger).

With a consumer group the group shares the partitions and commits; a record is settled
when its handler returns (`commit="on_return"`) or, for effects made durable later (the
learner's checkpoints), when `settled(tag)` says so (`commit="when_settled"`). A record
that does not decode or validate, or whose handler raises, is dead-lettered, and only once
the dead letter is acknowledged is it settled: the partition moves on and nothing is lost.
A handler that raises `Retryable` (a transient failure) gets the record again after a pause.

Without a group (`group_id=None`) the subscription reads every partition itself (a
`TopicReader`), commits nothing, and skips records it cannot use with a warning: the
topic's group consumers are the ones that dead-letter them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, cast

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord
from pydantic import BaseModel

from rlnode.bus import clients, dead_letters
from rlnode.bus.errors import Retryable
from rlnode.bus.ledger import OffsetLedger
from rlnode.bus.reader import TopicReader
from rlnode.bus.signing import RecordRefused
from rlnode.messages import DeadLetterError, JobEventType, topics
from rlnode.messages.codec import DecodeError, decode
from rlnode.service.supervised import Supervised

if TYPE_CHECKING:
    from rlnode.bus.core import Bus

log = logging.getLogger("rlnode.bus")

M = TypeVar("M", bound=BaseModel)
CommitPolicy = Literal["on_return", "when_settled"]
SEQUENTIAL_FETCH = 500  # records one fetch may bring when they are handled one at a time
MAX_DEAD_LETTERING = 1000  # dead letters awaiting the broker's acknowledgement at once
RETRY_FIRST_S, RETRY_LONGEST_S = 0.5, 10.0  # pauses before handling a Retryable again
Handler = Callable[[M, "Delivery"], Awaitable[Any]]


@dataclass(frozen=True)
class Delivery:
    """Where a record came from."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    timestamp_ms: int

    @classmethod
    def of(cls, record: ConsumerRecord) -> Delivery:
        return cls(record.topic, record.partition, record.offset, record.key, record.timestamp)


class Subscription(Generic[M]):
    def __init__(
        self,
        bus: Bus,
        topic: str,
        handler: Handler[M],
        *,
        group_id: str | None,
        model: type[M] | None = None,
        commit: CommitPolicy = "on_return",
        tag: Callable[[M], Hashable] | None = None,
        settled: Callable[[Any], bool] | None = None,
        concurrency: int = 1,
        from_beginning: bool = True,
        reject_event: JobEventType | Literal["default"] | None = "default",
        **consumer_options: Any,
    ) -> None:
        if commit == "when_settled" and (tag is None or settled is None or group_id is None):
            raise ValueError("commit='when_settled' needs a group_id, a tag and a settled check")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.bus = bus
        self.topic = topic
        self.handler = handler
        self.group_id = group_id
        # Without a model the handler takes the topic's own payload type.
        self.model: type[M] = model or cast("type[M]", topics.payload_type(topic))
        self.commit_policy = commit
        self._tag = tag
        self._settled = settled
        self.concurrency = concurrency
        self.from_beginning = from_beginning
        self.reject_event = (
            dead_letters.REJECT_EVENT.get(topic) if reject_event == "default" else reject_event
        )
        self._consumer_options = consumer_options
        self.ledger: OffsetLedger[Hashable] = OffsetLedger()
        self.assigned = asyncio.Event()  # a group consumer got its first partitions
        self._caught_up = asyncio.Event()  # group-less: what existed at the start is handled
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: TopicReader | None = None
        # The consuming loop, started again if it dies (a bug, a database that refused, a
        # commit the broker would not take). Records it had taken and not settled stay
        # uncommitted: a group reads them again.
        self._loop = Supervised(f"consuming {topic}", self._run)
        self._in_flight: set[asyncio.Task] = set()
        # Records whose producer is still being checked (the vault may be out of reach): not
        # begun, so a stop does not wait for them; they are read again.
        self._checking: set[asyncio.Task] = set()
        # Dead letters on their way to the broker: published in the background (so a flood
        # of bad records costs one batch of publishes, not a round trip each), each record
        # settled once its dead letter is acknowledged.
        self._dead_lettering: set[asyncio.Task] = set()
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        service = self.bus.service
        if self.group_id is None:
            # The consumer's options hold for a group-less reader too: the generator's weight
            # versions are read with the rollout path's short poll (B4: at the default 500 ms a
            # version waited ~150 ms for its fetch).
            self._reader = TopicReader(
                self.bus.settings,
                self.topic,
                service=service,
                from_beginning=self.from_beginning,
                **self._consumer_options,
            )
            await self._reader.start()
        else:
            consumer = clients.consumer(
                self.bus.settings,
                service,
                group_id=self.group_id,
                from_beginning=self.from_beginning,
                **self._consumer_options,
            )
            await clients.start_client(consumer.start(), consumer.stop, self.bus.settings)
            # Subscribed after the start, so that the group is joined in the background: a
            # consumer subscribed before would make `start` wait for the group's assignment
            # (seconds on a busy group), and a service would not answer its health check.
            consumer.subscribe([self.topic], listener=_Rebalance(self))
            self._consumer = consumer
        self._loop.start()

    async def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Stop fetching; let records in flight finish for up to `drain_timeout_s`; commit
        what is settled. What did not finish stays uncommitted for the group to read again."""
        self._stopping = True
        await self._loop.stop()
        for task in self._checking & self._in_flight:
            task.cancel()
        if self._in_flight or self._dead_lettering:
            waiting = self._in_flight | self._dead_lettering
            _done, pending = await asyncio.wait(waiting, timeout=drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._consumer is not None:
            # A fetch cancelled above may have closed the connection: a second try reconnects.
            for attempt in (1, 2):
                try:
                    await self.commit()
                    break
                except KafkaError as e:
                    if attempt == 2:
                        log.warning(
                            "%s: final commit on %s failed: %s", self.bus.service, self.topic, e
                        )
            await clients.close_consumer(self._consumer)
            self._consumer = None
        if self._reader is not None:
            await self._reader.stop()

    @property
    def caught_up(self) -> asyncio.Event:
        """Group-less: set once every record that existed at the start was handled."""
        if self.group_id is not None:
            raise RuntimeError("caught_up is for subscriptions without a group")
        return self._caught_up

    @property
    def partitions(self) -> list[int]:
        """The partitions this subscription reads now."""
        if self._consumer is not None:
            return sorted(tp.partition for tp in self._consumer.assignment())
        return self._reader.partitions if self._reader is not None else []

    async def wait_assigned(self, timeout_s: float = 30.0) -> None:
        """Until a group subscription holds partitions and knows where it reads from in
        each (so a record published after this is read, even from the latest offset)."""
        async with asyncio.timeout(timeout_s):
            await self.assigned.wait()
            assert self._consumer is not None
            for partition in self._consumer.assignment():
                await self._consumer.position(partition)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    # -- the loop ----------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why the consuming loop died, while it waits to be started again (None: running)."""
        return self._loop.failure

    @property
    def restarts(self) -> int:
        return self._loop.restarts

    async def _run(self) -> None:
        while not self._stopping:
            free = self.concurrency - len(self._in_flight)
            if free <= 0:
                await asyncio.wait(set(self._in_flight), return_when=asyncio.FIRST_COMPLETED)
                await self._commit_quietly()
                continue
            # Handled one by one, a fetch may bring many (a commit per fetch, not per record).
            records = await self._fetch(free if self.concurrency > 1 else SEQUENTIAL_FETCH)
            for index, record in enumerate(records):
                if self._stopping:
                    break  # fetched during shutdown: not taken, so read again by the group
                try:
                    if self._consumer is not None:
                        partition = TopicPartition(record.topic, record.partition)
                        self.ledger.track(partition, record.offset)
                    if self.concurrency == 1:
                        await self._handle(record)
                    else:
                        task = asyncio.create_task(self._handle(record))
                        self._in_flight.add(task)
                        task.add_done_callback(self._in_flight.discard)
                except Exception:
                    # The loop dies here: what it fetched and did not hand out is read again
                    # when it starts again, not skipped.
                    self._rewind(records[index:])
                    raise
            reader = self._reader
            if reader is not None and reader.caught_up.is_set() and not self._caught_up.is_set():
                if self._in_flight:
                    await asyncio.wait(set(self._in_flight))
                self._caught_up.set()
            await self._commit_quietly()

    def _rewind(self, untaken: list[ConsumerRecord]) -> None:
        consumer = self._consumer or (self._reader.consumer if self._reader else None)
        if consumer is None:
            return
        first: dict[TopicPartition, int] = {}
        for record in untaken:
            partition = TopicPartition(record.topic, record.partition)
            first[partition] = min(first.get(partition, record.offset), record.offset)
        for partition, offset in first.items():
            self.ledger.untrack_from(partition, offset)  # tracked again when read again
            consumer.seek(partition, offset)

    async def _fetch(self, max_records: int) -> list[ConsumerRecord]:
        try:
            if self._reader is not None:
                return await self._reader.fetch(max_records=max_records)
            assert self._consumer is not None
            batches = await self._consumer.getmany(timeout_ms=500, max_records=max_records)
        except KafkaError as e:
            # aiokafka retries the transient itself; what reaches here is logged and fetched
            # again, rather than ending the loop while the service looks healthy.
            log.error("%s: fetching %s failed (%s); trying again", self.bus.service, self.topic, e)
            await asyncio.sleep(1.0)
            return []
        return [record for batch in batches.values() for record in batch]

    async def _handle(self, record: ConsumerRecord) -> None:
        partition = TopicPartition(record.topic, record.partition)
        if record.value is None:
            await self._refuse(record, "decode", "the record has no value (a tombstone)", None)
            return
        producer = None
        verifier = self.bus.verifier
        if verifier is not None and record.topic not in topics.UNSIGNED_TOPICS:
            checking = asyncio.current_task()
            assert checking is not None
            self._checking.add(checking)
            try:
                producer = await verifier.producer(record)
            except RecordRefused as e:
                refused: RecordRefused | None = e
            else:
                refused = None
            finally:
                self._checking.discard(checking)
            if refused is not None:
                # No job event: an unsigned record changes nothing of the job it names.
                await self._refuse(record, "producer", refused.reason, None)
                return
        try:
            payload = decode(record.value, self.model)
        except DecodeError as e:
            await self._refuse(record, e.kind, e.reason, e.document)
            return
        if producer is not None and not topics.may_produce(producer, record.topic, payload):
            what = getattr(getattr(payload, "type", None), "value", type(payload).__name__)
            reason = f"{producer!r} may not produce {what} on {record.topic}"
            await self._refuse(record, "producer", reason, None)
            return
        try:
            await self._call(payload, record)
        except RecordRefused as e:  # the handler found it names what is not its producer's
            await self._refuse(record, "producer", e.reason, None)
            return
        except asyncio.CancelledError:
            if self.group_id is not None:
                log.info(
                    "%s: %s[%s]@%s was in flight at shutdown: left uncommitted for another "
                    "consumer of group %s",
                    self.bus.service,
                    *_where(record),
                    self.group_id,
                )
            raise
        except Exception as e:
            if self._stopping:  # the failure may be the shutdown itself: read it again
                log.warning("%s: %s at %s/%s left for a retry", self.bus.service, e, *_at(record))
                return
            log.exception("%s: handler for %s failed at %s/%s", self.bus.service, *_where(record))
            reason = f"the handler failed: {type(e).__name__}: {e}"
            document = {"job_id": getattr(payload, "job_id", None)}
            document["org_id"] = getattr(payload, "org_id", None)
            await self._refuse(record, "handler", reason, document)
            return
        if self._consumer is None:
            return
        if self.commit_policy == "on_return":
            self.ledger.settle(partition, record.offset)
        else:
            assert self._tag is not None
            self.ledger.tag(partition, record.offset, self._tag(payload))

    async def _call(self, payload: M, record: ConsumerRecord) -> None:
        """The handler, called again with backoff while it raises `Retryable` (a transient
        failure: dead-lettering would lose a record that will be good in a moment). At
        shutdown the record is left unsettled, for the group to read again."""
        delay = RETRY_FIRST_S
        while True:
            try:
                await self.handler(payload, Delivery.of(record))
                return
            except Retryable as e:
                if self._stopping:
                    raise
                log.warning(
                    "%s: %s[%s]@%s handled again in %.1fs: %s",
                    self.bus.service,
                    *_where(record),
                    delay,
                    e,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_LONGEST_S)

    async def _refuse(
        self, record: ConsumerRecord, error: DeadLetterError, reason: str, document: Any
    ) -> None:
        """Dead-letter a record (group consumers), or skip it (readers); then settle it."""
        if self._consumer is None:
            log.warning("%s: skipped %s[%s]@%s: %s", self.bus.service, *_where(record), reason)
            return
        letter = dead_letters.dead_letter(
            record,
            error,
            reason,
            consumer=self.bus.service,
            group_id=self.group_id,
            document=document,
        )
        log.warning("%s: dead-lettered %s[%s]@%s: %s", self.bus.service, *_where(record), reason)
        partition = TopicPartition(record.topic, record.partition)
        if record.topic == topics.DEAD_LETTERS:  # never loop: a bad dead letter is only logged
            self.ledger.settle(partition, record.offset)
            return
        event = dead_letters.event_for(letter, self.reject_event, self.bus.service)
        messages: list[BaseModel] = [letter] if event is None else [letter, event]
        while len(self._dead_lettering) >= MAX_DEAD_LETTERING:
            await asyncio.wait(set(self._dead_lettering), return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.create_task(self._dead_letter(messages, partition, record.offset))
        self._dead_lettering.add(task)
        task.add_done_callback(self._dead_lettering.discard)

    async def _dead_letter(
        self, messages: list[BaseModel], partition: TopicPartition, offset: int
    ) -> None:
        await self._publish_until_acknowledged(messages)
        self.ledger.settle(partition, offset)

    async def _publish_until_acknowledged(self, messages: list[BaseModel]) -> None:
        # Losing the dead letter is worse than waiting: the record is not settled until the
        # broker has it. On shutdown it stays unsettled and is read again.
        delay = 0.5
        while True:
            try:
                await self.bus.publish_all(messages)
                return
            except Exception as e:
                if self._stopping:
                    raise
                log.error(
                    "%s: could not publish a dead letter (%s); retrying in %.1fs",
                    self.bus.service,
                    e,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    # -- commits -----------------------------------------------------------------------

    async def commit(self) -> None:
        """Commit the settled prefix of every partition (group subscriptions)."""
        if self._consumer is None:
            return
        if self._settled is not None:
            self.ledger.settle_where(self._settled)
        offsets = self.ledger.committable()
        if offsets:
            await self._consumer.commit(offsets)

    async def _commit_quietly(self) -> None:
        try:
            await self.commit()
        except KafkaError as e:
            # A rebalance can refuse a commit; what was not committed is read again.
            log.warning("%s: commit on %s failed (%s); will retry", self.bus.service, self.topic, e)


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, subscription: Subscription) -> None:
        self.subscription = subscription

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.subscription._commit_quietly()
        self.subscription.ledger.forget(revoked)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        if assigned:
            self.subscription.assigned.set()


def _where(record: ConsumerRecord) -> tuple[str, int, int]:
    return record.topic, record.partition, record.offset


def _at(record: ConsumerRecord) -> tuple[int, int]:
    return record.partition, record.offset
