"""The bus: FastStream's KafkaBroker with rlnode's contract on top.

- connection, compression and size limits from KafkaSettings;
- topic creation with a partition count and a per-record size limit;
- publish keyed by `job_id`, so a job's records stay in order in one partition;
- subscriptions that decode into the topic's model and, when a record does not decode or
  validate (or its handler fails), send it to `rlnode.dead-letters` with the reason, tell
  the job it names, and go on with the next record: a bad record never blocks a partition.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, NoReturn, TypeVar

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError, MessageSizeTooLargeError
from aiokafka.partitioner import DefaultPartitioner
from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from pydantic import BaseModel

from rlnode.messages import ID_PATTERN, DeadLetter, Envelope, JobEvent, JobEventType, topics
from rlnode.messages.codec import DecodeError, decode, encode

log = logging.getLogger("rlnode.bus")

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[M, "Delivery"], Awaitable[None]]
CommitMode = Literal["after_handle", "manual", "none"]

# A dead letter keeps at most this much of the bad record, so that it still fits the topic.
DEAD_LETTER_PAYLOAD_LIMIT = 1024 * 1024
SCHEMA_HEADER = "rlnode-schema"

# Which job event a bad record on each topic earns the job it names (DESIGN.md §2).
# Job events and dead letters earn none: a bad event must not beget more events.
DEFAULT_REJECT_EVENT: dict[str, JobEventType | None] = {
    topics.JOB_REQUESTS: JobEventType.REJECTED,
    topics.ROLLOUT_WORK: JobEventType.FAILED,
    topics.TRAJECTORIES: JobEventType.FAILED,
    topics.WEIGHT_VERSIONS: JobEventType.FAILED,
    topics.JOB_EVENTS: None,
    topics.DEAD_LETTERS: None,
}

_id_re = re.compile(ID_PATTERN)


class BusError(RuntimeError):
    pass


class BusUnavailable(BusError):
    pass


class RecordTooLarge(BusError):
    def __init__(self, topic: str, size: int, limit: int) -> None:
        super().__init__(
            f"a {size:,}-byte record does not fit {topic} (limit {limit:,} bytes); raise "
            "KAFKA_MAX_MESSAGE_BYTES (and the topic's max.message.bytes) or send less"
        )
        self.topic, self.size, self.limit = topic, size, limit


@dataclass(frozen=True)
class Published:
    topic: str
    partition: int
    offset: int


@dataclass
class Delivery:
    """Where a record came from, and (in "manual" commit mode) how to commit it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    timestamp_ms: int
    _message: Any = field(repr=False)

    async def commit(self) -> None:
        """Commit the consumer group's position up to and including this record (and every
        record before it on the partitions this consumer holds)."""
        await self._message.ack()


@dataclass
class Subscription(Generic[M]):
    topic: str
    group_id: str | None
    model: type[M]
    subscriber: Any


class Bus:
    def __init__(self, settings: Any, *, service: str) -> None:
        """`settings` is a KafkaSettings; `service` names this process in dead letters and
        events (e.g. "learner", "rollout-generator/gen-0")."""
        self.settings = settings
        self.service = service
        self._started = False
        self.broker = KafkaBroker(
            bootstrap_servers=settings.bootstrap_servers,
            client_id=f"{settings.client_id_prefix}-{service.replace('/', '-')}",
            compression_type=None if settings.compression == "none" else settings.compression,
            # aiokafka checks the size before compression; the topic checks it after.
            max_request_size=self.max_uncompressed_bytes,
            linger_ms=settings.linger_ms,
            acks="all",
            request_timeout_ms=settings.request_timeout_ms,
            allow_auto_create_topics=False,
            logger=_faststream_logger(service),
            log_level=logging.DEBUG,
            graceful_timeout=15.0,
        )

    @property
    def max_uncompressed_bytes(self) -> int:
        # Token-id JSON compresses 3-5x with zstd; allow that much headroom before compression.
        return self.settings.max_message_bytes * 4

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self.broker.start()
        except (TimeoutError, KafkaConnectionError, OSError) as e:
            raise BusUnavailable(self._unreachable(e)) from e
        self._started = True

    async def stop(self) -> None:
        if self._started:
            self._started = False
            await self.broker.stop()

    async def __aenter__(self) -> Bus:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _unreachable(self, error: BaseException) -> str:
        return (
            f"cannot reach Kafka at {self.settings.bootstrap_servers} ({error}); start a broker "
            "(`rlnode broker`) or set KAFKA_BOOTSTRAP_SERVERS to one that runs"
        )

    # -- topics --------------------------------------------------------------------------

    async def ensure_topics(
        self, names: tuple[str, ...] = topics.ALL_TOPICS, partitions: int | None = None
    ) -> list[str]:
        """Create the topics that do not exist yet; returns the ones it created."""
        return await ensure_topics(self.settings, names, partitions)

    # -- publishing ----------------------------------------------------------------------

    async def publish(self, message: BaseModel, topic: str | None = None) -> Published:
        """Publish a payload, keyed by its job id, to its topic (inferred from its type)."""
        return (await self.publish_all([message], topic))[0]

    async def publish_all(
        self, messages: list[BaseModel], topic: str | None = None
    ) -> list[Published]:
        """Publish payloads in this order and wait for every acknowledgement at once: the
        producer batches them, where awaiting each in turn costs a broker round trip (and
        the linger) per record."""
        pending: list[asyncio.Future] = []
        sizes: list[tuple[str, int]] = []  # (topic, bytes) of each record handed over
        try:
            for message in messages:
                destination = topic or topic_for(message)
                raw = encode(message)
                if len(raw) > self.max_uncompressed_bytes:
                    raise RecordTooLarge(destination, len(raw), self.max_uncompressed_bytes)
                sizes.append((destination, len(raw)))
                pending.append(
                    await self.broker.publish(
                        raw,
                        topic=destination,
                        key=_key_of(message),
                        headers={SCHEMA_HEADER: message.SCHEMA},
                        no_confirm=True,  # a future of the acknowledgement, awaited below
                    )
                )
        except BaseException as e:
            # What was handed over before the failure settles first (like publishing in turn).
            await asyncio.gather(*pending, return_exceptions=True)
            if sizes:  # a size refusal comes before sending: it is the last record's
                self._raise_publish_error(e, *sizes[-1])
            raise
        metas = await asyncio.gather(*pending, return_exceptions=True)
        for (destination, size), meta in zip(sizes, metas, strict=True):
            if isinstance(meta, BaseException):
                self._raise_publish_error(meta, destination, size)
        return [Published(m.topic, m.partition, m.offset) for m in metas]

    def _raise_publish_error(self, error: BaseException, topic: str, size: int) -> NoReturn:
        """Raise a failed publish of a `size`-byte record to `topic` as this module names it."""
        if isinstance(error, MessageSizeTooLargeError):
            raise RecordTooLarge(topic, size, self.settings.max_message_bytes) from error
        if isinstance(error, KafkaConnectionError):
            raise BusUnavailable(self._unreachable(error)) from error
        raise error

    # -- consuming -----------------------------------------------------------------------

    def subscribe(
        self,
        topic: str,
        handler: Handler[M],
        *,
        group_id: str | None,
        model: type[M] | None = None,
        commit: CommitMode = "after_handle",
        from_beginning: bool = True,
        reject_event: JobEventType | Literal["default"] | None = "default",
        max_records: int | None = None,
    ) -> Subscription[M]:
        """Call `handler(payload, delivery)` for each record of `topic`, in order per partition.

        commit="after_handle": the group's offset is committed after the handler returns
        (or after the record was dead-lettered). "manual": the handler (or whoever it hands
        the delivery to) calls `delivery.commit()` when the record's effect is durable; a
        dead-lettered record is then committed by the next such commit. "none": no offsets
        are committed (readers without a group).
        """
        model = model or topics.payload_type(topic)
        event = DEFAULT_REJECT_EVENT.get(topic) if reject_event == "default" else reject_event
        policy = {
            "after_handle": AckPolicy.ACK,
            "manual": AckPolicy.MANUAL,
            "none": AckPolicy.ACK_FIRST,
        }[commit]
        if commit != "none" and group_id is None:
            raise ValueError("committing offsets needs a group_id; use commit='none' without one")
        fetch_limit = self.settings.max_message_bytes + 1024 * 1024
        subscriber = self.broker.subscriber(
            topic,
            group_id=group_id,
            auto_offset_reset="earliest" if from_beginning else "latest",
            ack_policy=policy,
            max_partition_fetch_bytes=fetch_limit,
            fetch_max_bytes=max(fetch_limit, 50 * 1024 * 1024),
            max_poll_records=max_records,
            fetch_max_wait_ms=self.settings.fetch_max_wait_ms,
            session_timeout_ms=self.settings.session_timeout_ms,
            heartbeat_interval_ms=self.settings.heartbeat_interval_ms,
            include_in_schema=False,
        )

        async def on_record(message: KafkaMessage) -> None:
            record = message.raw_message
            delivery = Delivery(
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                key=record.key,
                timestamp_ms=record.timestamp,
                _message=message,
            )
            payload = await self.accept(record, model, group_id=group_id, reject_event=event)
            if payload is None:
                return
            try:
                await handler(payload, delivery)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.exception(
                    "%s: handler for %s failed at %s/%s",
                    self.service,
                    topic,
                    record.partition,
                    record.offset,
                )
                reason = f"the handler failed: {type(e).__name__}: {e}"
                named = {
                    "job_id": getattr(payload, "job_id", None),
                    "org_id": getattr(payload, "org_id", None),
                }
                await self._dead_letter(
                    _where(record), record.value, "handler", reason, group_id, event, named
                )

        subscriber(on_record)
        return Subscription(topic=topic, group_id=group_id, model=model, subscriber=subscriber)

    async def accept(
        self,
        record: Any,
        model: type[M],
        *,
        group_id: str | None,
        reject_event: JobEventType | Literal["default"] | None = "default",
    ) -> M | None:
        """Decode a consumer record into `model`; if it does not decode or validate, dead-letter
        it (telling the job it names) and return None. For consumers of our own making."""
        try:
            return _decode_record(record.value, model)
        except DecodeError as e:
            event = (
                DEFAULT_REJECT_EVENT.get(record.topic)
                if reject_event == "default"
                else reject_event
            )
            await self._dead_letter(
                _where(record), record.value, e.kind, e.reason, group_id, event, e.document
            )
            return None

    def consumer(
        self, *names: str, group_id: str | None, from_beginning: bool = True, **options: Any
    ):
        """A raw aiokafka consumer with this bus's connection and size settings, committing
        nothing by itself: for consumers that track their own offsets."""
        from aiokafka import AIOKafkaConsumer

        fetch_limit = self.settings.max_message_bytes + 1024 * 1024
        return AIOKafkaConsumer(
            *names,
            bootstrap_servers=self.settings.bootstrap_servers,
            client_id=f"{self.settings.client_id_prefix}-{self.service.replace('/', '-')}",
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest" if from_beginning else "latest",
            max_partition_fetch_bytes=fetch_limit,
            fetch_max_bytes=max(fetch_limit, 50 * 1024 * 1024),
            fetch_max_wait_ms=self.settings.fetch_max_wait_ms,
            session_timeout_ms=self.settings.session_timeout_ms,
            heartbeat_interval_ms=self.settings.heartbeat_interval_ms,
            request_timeout_ms=self.settings.request_timeout_ms,
            **options,
        )

    async def start_subscription(self, subscription: Subscription[Any]) -> None:
        """Start a subscription added after the bus started."""
        await subscription.subscriber.start()

    async def _dead_letter(
        self,
        delivery: _Where,
        value: bytes | None,
        error: str,
        reason: str,
        group_id: str | None,
        event: JobEventType | None,
        document: Any,
    ) -> None:
        value = value or b""
        job_id, org_id = _named_job(document)
        letter = DeadLetter(
            job_id=job_id,
            org_id=org_id,
            source_topic=delivery.topic,
            partition=delivery.partition,
            offset=delivery.offset,
            key=delivery.key.decode(errors="replace") if delivery.key else None,
            consumer=self.service,
            consumer_group=group_id,
            error=error,
            reason=reason,
            payload_b64=base64.b64encode(value[:DEAD_LETTER_PAYLOAD_LIMIT]).decode(),
            payload_size=len(value),
            payload_truncated=len(value) > DEAD_LETTER_PAYLOAD_LIMIT,
        )
        log.warning(
            "%s: dead-lettered %s[%s]@%s: %s",
            self.service,
            delivery.topic,
            delivery.partition,
            delivery.offset,
            reason,
        )
        if delivery.topic == topics.DEAD_LETTERS:
            return  # never loop: a bad dead letter is only logged
        try:
            await self.publish(letter, topics.DEAD_LETTERS)
            if event is not None and job_id and org_id:
                await self.publish(
                    JobEvent(
                        job_id=job_id,
                        org_id=org_id,
                        type=event,
                        source=self.service,
                        message=f"a {delivery.topic} record for this job was unusable: {reason}",
                        data={
                            "reason": reason,
                            "dead_letter_id": str(letter.id),
                            "topic": delivery.topic,
                            "partition": delivery.partition,
                            "offset": delivery.offset,
                        },
                    )
                )
        except KafkaError:
            # Losing the dead letter is worse than re-reading the record: don't commit it.
            log.exception(
                "%s: could not publish the dead letter; the record stays uncommitted", self.service
            )
            raise


class _DropTopicCreationWarning(logging.Filter):
    # FastStream warns on every subscriber start that it will not create topics; that is
    # on purpose here (ensure_topics creates them with the right partition count).
    def filter(self, record: logging.LogRecord) -> bool:
        return "Auto create topics is disabled" not in record.getMessage()


def _faststream_logger(service: str) -> logging.Logger:
    logger = logging.getLogger(f"rlnode.bus.{service}")
    if not any(isinstance(f, _DropTopicCreationWarning) for f in logger.filters):
        logger.addFilter(_DropTopicCreationWarning())
    return logger


@dataclass(frozen=True)
class _Where:
    topic: str
    partition: int
    offset: int
    key: bytes | None


def _where(record: Any) -> _Where:
    return _Where(record.topic, record.partition, record.offset, record.key)


def topic_for(message: BaseModel) -> str:
    for name in topics.ALL_TOPICS:
        if isinstance(message, topics.payload_type(name)):
            return name
    raise ValueError(f"{type(message).__name__} has no topic of its own; pass topic=")


def partition_for(job_id: str, partitions: Iterable[int]) -> int:
    """The partition that records keyed by `job_id` land on: Kafka's default partitioner
    (murmur2 of the key), which every producer here uses, over the topic's partitions."""
    ordered = sorted(partitions)
    return DefaultPartitioner()(job_id.encode(), ordered, ordered)


def _key_of(message: BaseModel) -> bytes | None:
    if isinstance(message, Envelope):
        return message.key
    if isinstance(message, DeadLetter):
        # Keyed like the record it carries, so a job's dead letters keep their order too.
        key = message.key or message.job_id
        return key.encode() if key else None
    return None


def _decode_record(value: bytes | None, model: type[M]) -> M:
    if value is None:
        raise DecodeError("decode", "the record has no value (a tombstone)")
    return decode(value, model)


def _named_job(document: Any) -> tuple[str | None, str | None]:
    """The job and org a bad record names, if it parsed as JSON and names well-formed ones."""
    if not isinstance(document, dict):
        return None, None
    job_id, org_id = document.get("job_id"), document.get("org_id")
    ok = lambda v: isinstance(v, str) and _id_re.match(v) is not None  # noqa: E731
    return (job_id if ok(job_id) else None), (org_id if ok(org_id) else None)


async def ensure_topics(
    settings: Any, names: tuple[str, ...] = topics.ALL_TOPICS, partitions: int | None = None
) -> list[str]:
    """Create the named topics with the partition count and size limit from settings;
    topics that already exist are left as they are. Returns the ones it created."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.bootstrap_servers,
        client_id=f"{settings.client_id_prefix}-admin",
        request_timeout_ms=settings.request_timeout_ms,
    )
    try:
        await admin.start()
    except (KafkaConnectionError, OSError) as e:
        raise BusUnavailable(
            f"cannot reach Kafka at {settings.bootstrap_servers} ({e}); start a broker "
            "(`rlnode broker`) or set KAFKA_BOOTSTRAP_SERVERS to one that runs"
        ) from e
    try:
        existing = set(await admin.list_topics())
        wanted = [n for n in names if n not in existing]
        if not wanted:
            return []
        response = await admin.create_topics(
            [
                NewTopic(
                    name,
                    num_partitions=partitions or settings.partitions,
                    replication_factor=settings.replication_factor,
                    topic_configs={"max.message.bytes": str(settings.max_message_bytes)},
                )
                for name in wanted
            ]
        )
        created = []
        for name, code, message in response.topic_errors:
            if code == 0:
                created.append(name)
            elif code != 36:  # 36 = TOPIC_ALREADY_EXISTS: someone else created it meanwhile
                raise BusError(f"could not create topic {name}: error {code}: {message}")
        return created
    finally:
        await admin.close()
