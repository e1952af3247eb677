"""aiokafka clients with rlnode's settings (connection, compression, size limits, group
timing), and the admin operations: topic creation and partition lookup."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError
from aiokafka.helpers import create_ssl_context
from aiokafka.partitioner import DefaultPartitioner

from rlnode.bus.errors import BusError, BusUnavailable, unreachable
from rlnode.bus.settings import KafkaSettings
from rlnode.messages import topics

TOPIC_ALREADY_EXISTS = 36
CONSUMER_CLOSE_TIMEOUT_S = 5.0

log = logging.getLogger("rlnode.bus")


def client_id(settings: KafkaSettings, service: str) -> str:
    return f"{settings.client_id_prefix}-{service.replace('/', '-')}"


def max_uncompressed_bytes(settings: KafkaSettings) -> int:
    # Token-id JSON compresses 3-5x with zstd; allow that much headroom before compression.
    return settings.max_message_bytes * 4


def connection(settings: KafkaSettings) -> dict[str, Any]:
    """Where and how every client connects: the bootstrap servers, TLS (with a client
    certificate, for SSL), and the SASL user (rlnode.bus.principals)."""
    options: dict[str, Any] = {"bootstrap_servers": settings.bootstrap_servers}
    if settings.security_protocol != "PLAINTEXT":
        options["security_protocol"] = settings.security_protocol
        options["ssl_context"] = ssl_context(settings)
    if settings.security_protocol == "SASL_SSL":
        assert settings.sasl_password is not None
        options["sasl_mechanism"] = settings.sasl_mechanism
        options["sasl_plain_username"] = settings.sasl_username
        options["sasl_plain_password"] = settings.sasl_password.get_secret_value()
    return options


def ssl_context(settings: KafkaSettings) -> ssl.SSLContext:
    def path(value: object) -> str | None:
        return str(value) if value is not None else None

    try:
        return create_ssl_context(
            cafile=path(settings.ssl_cafile),
            certfile=path(settings.ssl_certfile),
            keyfile=path(settings.ssl_keyfile),
        )
    except (OSError, ssl.SSLError) as e:
        raise BusError(
            f"cannot use the Kafka client certificate ({settings.ssl_certfile}, key "
            f"{settings.ssl_keyfile}, CA {settings.ssl_cafile}): {e}"
        ) from e


async def refused_login(settings: KafkaSettings) -> str | None:
    """Why the first bootstrap broker refused this client's SASL login, if it did; else None.

    aiokafka reports a refused login as "unable to bootstrap", like a broker that is down;
    one connection of its own to the first broker gets the broker's own reason."""
    if settings.security_protocol != "SASL_SSL":
        return None
    from aiokafka.conn import create_conn
    from aiokafka.errors import SaslAuthenticationFailed, UnsupportedSaslMechanismError

    host, _, port = settings.bootstrap_servers.split(",")[0].strip().rpartition(":")
    options = connection(settings)
    try:
        conn = await asyncio.wait_for(
            create_conn(
                host.strip("[]"),
                int(port),
                security_protocol=options["security_protocol"],
                ssl_context=options["ssl_context"],
                sasl_mechanism=options["sasl_mechanism"],
                sasl_plain_username=options["sasl_plain_username"],
                sasl_plain_password=options["sasl_plain_password"],
            ),
            timeout=10,
        )
    except (SaslAuthenticationFailed, UnsupportedSaslMechanismError) as e:
        return str(e)
    except Exception:  # not a refusal: down, unreachable, TLS (said by the caller's error)
        return None
    conn.close()
    return None


async def connect_error(settings: KafkaSettings, error: BaseException) -> BusError:
    """The error to raise when a client could not start: a refused login names the user;
    anything else is the broker being out of reach."""
    refusal = await refused_login(settings)
    if refusal is not None:
        return BusError(
            f"Kafka at {settings.bootstrap_servers} refused the login of Kafka user "
            f"{settings.sasl_username!r} ({settings.sasl_mechanism}): {refusal}. Check "
            "KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD (`rlnode kafka-credentials` prints "
            "an org's; a node's services get theirs from `rlnode up`)"
        )
    return unreachable(settings.bootstrap_servers, error)


def producer(settings: KafkaSettings, service: str) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        **connection(settings),
        client_id=client_id(settings, service),
        compression_type=None if settings.compression == "none" else settings.compression,
        # aiokafka checks the size before compression; the topic checks it after.
        max_request_size=max_uncompressed_bytes(settings),
        linger_ms=settings.linger_ms,
        acks="all",
        # Retries after a broker fails over write nothing twice (with acks=all above).
        enable_idempotence=True,
        request_timeout_ms=settings.request_timeout_ms,
    )


def consumer(
    settings: KafkaSettings,
    service: str,
    *,
    group_id: str | None,
    from_beginning: bool = True,
    **options: Any,
) -> AIOKafkaConsumer:
    """A consumer that commits nothing by itself (the subscription commits what is settled)
    and fetches records up to the topics' size limit."""
    fetch_limit = settings.max_message_bytes + 1024 * 1024
    defaults: dict[str, Any] = {
        **connection(settings),
        "client_id": client_id(settings, service),
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest" if from_beginning else "latest",
        "max_partition_fetch_bytes": fetch_limit,
        "fetch_max_bytes": max(fetch_limit, 50 * 1024 * 1024),
        "fetch_max_wait_ms": settings.fetch_max_wait_ms,
        "session_timeout_ms": settings.session_timeout_ms,
        "heartbeat_interval_ms": settings.heartbeat_interval_ms,
        "request_timeout_ms": settings.request_timeout_ms,
    }
    return AIOKafkaConsumer(**(defaults | options))  # `options` win (e.g. max_poll_interval_ms)


async def close_consumer(
    consumer: AIOKafkaConsumer, timeout_s: float = CONSUMER_CLOSE_TIMEOUT_S
) -> None:
    """Stop a consumer, giving up after `timeout_s`: aiokafka's stop first waits for its
    group coordination to finish what it is doing (a JoinGroup the broker holds, a lookup of
    a coordinator not there yet), and a service stopping must not wait on that. A group left
    without a LeaveGroup drops the member after its session timeout."""
    try:
        async with asyncio.timeout(timeout_s):
            await consumer.stop()
    except TimeoutError:
        log.warning(
            "a consumer did not stop within %.0fs; closed without leaving its group", timeout_s
        )
        with contextlib.suppress(Exception):
            await consumer._client.close()  # its connections (stop cancelled before it got there)
    except Exception as e:  # a stop that fails leaves nothing to do but say so
        log.warning("a consumer's stop failed: %s", e)


def admin(settings: KafkaSettings) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(
        **connection(settings),
        client_id=f"{settings.client_id_prefix}-admin",
        request_timeout_ms=settings.request_timeout_ms,
    )


async def start_client(
    start: Awaitable[None],
    close: Callable[[], Awaitable[Any]],
    settings: KafkaSettings,
    unreachable_errors: tuple[type[BaseException], ...] = (KafkaConnectionError, OSError),
) -> None:
    """Start an aiokafka client (`start`: its start(); `close`: its stop() or close()).
    One that cannot reach the brokers is closed and raised as connect_error says (a refused
    login names the user); one cancelled meanwhile is closed too, nothing left open.

    The start runs to its end even when the caller is cancelled, and the cancellation goes
    through after it: aiokafka's bootstrap leaves its connection open when cancelled
    mid-request (AIOKafkaClient.bootstrap closes it only on a Kafka error or a timeout), and
    an event stream whose HTTP client went away left one behind. The wait is bounded by the
    client's request timeout."""
    started = asyncio.ensure_future(start)
    try:
        await asyncio.shield(started)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):  # its own failure is not the caller's news
            await started
        await close()
        raise
    except unreachable_errors as e:
        await close()
        raise await connect_error(settings, e) from e
    except BaseException:
        await close()
        raise


async def _started(client: AIOKafkaAdminClient, settings: KafkaSettings) -> None:
    await start_client(client.start(), client.close, settings)


# A cluster whose brokers just started may not have registered them all yet: a topic with
# three replicas is refused (InvalidReplicationFactor) until it has. Tried again this long.
CLUSTER_FORMING_S = 60.0
INVALID_REPLICATION_FACTOR = 38


async def ensure_topics(
    settings: KafkaSettings,
    names: Iterable[str] = topics.ALL_TOPICS,
    partitions: int | None = None,
    replication_factor: int | None = None,
    forming_s: float = CLUSTER_FORMING_S,
) -> list[str]:
    """Create the named topics with the partition count, replication and size limit from
    settings (or as given) and rlnode's retention (topics.RETENTION); topics that already
    exist are left as they are. Returns the ones it created. Replication the cluster cannot
    give yet (its brokers still registering) is asked again for `forming_s`."""
    replicas = replication_factor or settings.replication_factor
    client = admin(settings)
    await _started(client, settings)
    deadline = time.monotonic() + forming_s
    created: list[str] = []
    try:
        while True:
            existing = {entry["topic"] for entry in await described_topics(client, settings)}
            wanted = [n for n in names if n not in existing]
            if not wanted:
                return created
            response = await client.create_topics(
                [
                    NewTopic(
                        name,
                        num_partitions=partitions or settings.partitions,
                        replication_factor=replicas,
                        topic_configs={
                            "max.message.bytes": str(settings.max_message_bytes),
                            **topics.retention_configs(name),
                        },
                    )
                    for name in wanted
                ]
            )
            forming = False
            for name, code, message in response.topic_errors:
                if code == 0:
                    created.append(name)
                elif code == INVALID_REPLICATION_FACTOR and time.monotonic() < deadline:
                    forming = True
                elif code != TOPIC_ALREADY_EXISTS:  # someone else created it meanwhile
                    raise BusError(f"could not create topic {name}: error {code}: {message}")
            if not forming:
                return created
            await asyncio.sleep(1.0)
    finally:
        await client.close()


# How long a metadata request is tried again while the broker it went to is down.
METADATA_RETRY_S = 30.0


async def described_topics(
    client: AIOKafkaAdminClient, settings: KafkaSettings, retry_s: float = METADATA_RETRY_S
) -> list[dict]:
    """Every topic's metadata, from whichever broker answers. The admin client sends it to a
    broker picked at random from the metadata it holds, which names a broker that just died
    until the controllers fence it (a generator started again beside its killed broker
    failed its start so, in tests/multihost): a retriable error is tried again, on another
    pick, for `retry_s`."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            return await client.describe_topics()
        except KafkaError as e:
            if not e.retriable or time.monotonic() > deadline:
                raise unreachable(settings.bootstrap_servers, e) from e
        await asyncio.sleep(0.2)


async def topic_names(settings: KafkaSettings) -> set[str]:
    """The topics this client may see (Describe) on the cluster."""
    client = admin(settings)
    await _started(client, settings)
    try:
        return {entry["topic"] for entry in await described_topics(client, settings)}
    finally:
        await client.close()


async def topic_partitions(settings: KafkaSettings, topic: str, wait_s: float = 10.0) -> list[int]:
    """The partitions of `topic`, waiting up to `wait_s` for it to exist. Asks for every
    topic's metadata: a request naming the topic could make the broker create it."""
    client = admin(settings)
    await _started(client, settings)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            for entry in await described_topics(client, settings):
                if entry["topic"] == topic and entry["partitions"]:
                    return sorted(p["partition"] for p in entry["partitions"])
            if time.monotonic() > deadline:
                raise BusUnavailable(
                    f"the topic {topic} does not exist on {settings.bootstrap_servers}; "
                    "run `rlnode topics create` (rlnode up and rlnode broker create it)"
                )
            await asyncio.sleep(0.2)
    finally:
        await client.close()


async def replication_of(settings: KafkaSettings, topic: str) -> int:
    """How many replicas `topic`'s first partition has (what a topic made like it gets)."""
    client = admin(settings)
    await _started(client, settings)
    try:
        described = await described_topics(client, settings)
    finally:
        await client.close()
    for entry in described:
        if entry["topic"] == topic and entry["partitions"]:
            return len(min(entry["partitions"], key=lambda p: p["partition"])["replicas"])
    raise BusUnavailable(f"the topic {topic} does not exist on {settings.bootstrap_servers}")


def partition_for(job_id: str, partitions: Iterable[int]) -> int:
    """The partition that records keyed by `job_id` land on: Kafka's default partitioner
    (murmur2 of the key), which every producer here uses, over the topic's partitions."""
    ordered = sorted(partitions)
    return DefaultPartitioner()(job_id.encode(), ordered, ordered)
