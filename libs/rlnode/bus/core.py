"""The bus: one producer and any number of subscriptions of one process, on aiokafka.

- publish keyed by `job_id`, so a job's records stay in order in one partition; a step's
  records in one go (`publish_all`);
- subscriptions (`subscribe`) that decode, validate, dead-letter, bound what is in flight
  and commit only what is settled; readers (`reader`) for watchers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError
from pydantic import BaseModel

from rlnode.bus import clients
from rlnode.bus.errors import RecordTooLarge, unreachable
from rlnode.bus.reader import TopicReader
from rlnode.bus.settings import KafkaSettings
from rlnode.bus.signing import RecordSigner, RecordVerifier
from rlnode.bus.subscription import Delivery, Subscription
from rlnode.messages import DeadLetter, Envelope, topics
from rlnode.messages.codec import encode

M = TypeVar("M", bound=BaseModel)
SCHEMA_HEADER = "rlnode-schema"


@dataclass(frozen=True)
class Published:
    topic: str
    partition: int
    offset: int


class Bus:
    def __init__(
        self,
        settings: KafkaSettings,
        *,
        service: str,
        signer: RecordSigner | None = None,
        verifier: RecordVerifier | None = None,
    ) -> None:
        """`service` names this process in dead letters, events and client ids (e.g.
        "learner", "rollout-generator/gen-0"); `signer` signs what it publishes, `verifier`
        checks who produced what its subscriptions read (rlnode.bus.signing)."""
        self.settings = settings
        self.service = service
        self.signer = signer
        self.verifier = verifier
        self.subscriptions: list[Subscription[Any]] = []
        self._producer: AIOKafkaProducer | None = None

    @property
    def max_uncompressed_bytes(self) -> int:
        return clients.max_uncompressed_bytes(self.settings)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Have the signing key certified, connect the producer, then start the
        subscriptions made so far."""
        if self.signer is not None:
            try:
                await self.signer.start()
            except Exception as e:
                raise RuntimeError(
                    f"{self.service}: cannot get a certificate for its record key from the "
                    f"vault at {self.signer.vault_url}: {e}"
                ) from e
        producer = clients.producer(self.settings, self.service)
        await clients.start_client(
            producer.start(),
            producer.stop,
            self.settings,
            unreachable_errors=(TimeoutError, KafkaConnectionError, OSError),
        )
        self._producer = producer
        for subscription in self.subscriptions:
            await subscription.start()

    async def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Stop the subscriptions (records in flight get `drain_timeout_s` to finish), then
        the producer, which delivers what it holds."""
        await asyncio.gather(*(s.stop(drain_timeout_s) for s in self.subscriptions))
        producer, self._producer = self._producer, None
        if producer is not None:
            await producer.stop()

    async def __aenter__(self) -> Bus:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def failures(self) -> dict[str, str]:
        """{"consuming <topic>": why} for each subscription whose loop is down (being started
        again): a service's /health reports them (`app.state.failures`)."""
        return {
            f"consuming {s.topic}": s.failure for s in self.subscriptions if s.failure is not None
        }

    async def ensure_topics(
        self, names: Iterable[str] = topics.ALL_TOPICS, partitions: int | None = None
    ) -> list[str]:
        """Create the topics that do not exist yet; returns the ones it created."""
        return await clients.ensure_topics(self.settings, names, partitions)

    # -- publishing --------------------------------------------------------------------

    async def publish(self, message: BaseModel, topic: str | None = None) -> Published:
        """Publish a payload, keyed by its job id, to its topic (inferred from its type)."""
        return (await self.publish_all([message], topic))[0]

    async def publish_all(
        self, messages: Sequence[BaseModel], topic: str | None = None
    ) -> list[Published]:
        """Publish payloads in this order and wait for every acknowledgement at once: the
        producer batches them, where awaiting each in turn costs a broker round trip (and
        the linger) per record."""
        if self._producer is None:
            raise RuntimeError(f"{self.service}: start the bus before publishing")
        pending: list[asyncio.Future] = []
        sizes: list[tuple[str, int]] = []  # (topic, bytes) of each record handed over
        try:
            for message in messages:
                destination = topic or topics.topic_for(message)
                raw = encode(message)
                if len(raw) > self.max_uncompressed_bytes:
                    raise RecordTooLarge(destination, len(raw), self.max_uncompressed_bytes)
                sizes.append((destination, len(raw)))
                key = _key_of(message)
                headers = [(SCHEMA_HEADER, getattr(message, "SCHEMA", "").encode())]
                if self.signer is not None:
                    headers += self.signer.headers(destination, key, raw)
                pending.append(
                    await self._producer.send(destination, raw, key=key, headers=headers)
                )
        except BaseException as e:
            # What was handed over before the failure settles first (like publishing in turn).
            await asyncio.gather(*pending, return_exceptions=True)
            if sizes:  # a size refusal comes before sending: it is the last record's
                self._raise_publish_error(e, *sizes[-1])
            raise
        try:
            metas = await asyncio.wait_for(
                asyncio.gather(*pending, return_exceptions=True),
                self.settings.delivery_timeout_ms / 1000,
            )
        except TimeoutError:
            raise unreachable(
                self.settings.bootstrap_servers,
                f"no acknowledgement of {len(pending)} record(s) within "
                f"{self.settings.delivery_timeout_ms / 1000:g}s (KAFKA_DELIVERY_TIMEOUT_MS)",
            ) from None
        published: list[Published] = []
        for (destination, size), meta in zip(sizes, metas, strict=True):
            if isinstance(meta, BaseException):
                self._raise_publish_error(meta, destination, size)
            published.append(Published(meta.topic, meta.partition, meta.offset))
        return published

    def _raise_publish_error(self, error: BaseException, topic: str, size: int) -> NoReturn:
        """Raise a failed publish of a `size`-byte record to `topic` as this package names it."""
        if isinstance(error, MessageSizeTooLargeError):
            raise RecordTooLarge(topic, size, self.settings.max_message_bytes) from error
        if isinstance(error, KafkaConnectionError):
            raise unreachable(self.settings.bootstrap_servers, error) from error
        raise error

    # -- consuming ---------------------------------------------------------------------

    def subscribe(
        self,
        topic: str,
        handler: Callable[[M, Delivery], Awaitable[Any]],
        *,
        group_id: str | None,
        **options: Any,
    ) -> Subscription[M]:
        """Call `handler(payload, delivery)` for each record of `topic` (see Subscription
        for the options). Started with the bus, or now if the bus runs already: then
        await `start()` on what this returns."""
        subscription: Subscription[M] = Subscription(
            self, topic, handler, group_id=group_id, **options
        )
        self.subscriptions.append(subscription)
        return subscription

    def reader(self, topic: str, *, key: str | None = None, from_beginning: bool = True):
        """A group-less reader of `topic` (of the partition `key` lands on, if given)."""
        return TopicReader(
            self.settings, topic, service=self.service, key=key, from_beginning=from_beginning
        )


def _key_of(message: BaseModel) -> bytes | None:
    if isinstance(message, Envelope):
        return message.key
    if isinstance(message, DeadLetter):
        # Keyed like the record it carries, so a job's dead letters keep their order too.
        key = message.key or message.job_id
        return key.encode() if key else None
    return None
