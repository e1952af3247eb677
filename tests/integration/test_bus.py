"""The bus over a real broker: round trips, dead letters, ordering, commits, limits."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import signal

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from rlnode.bus import Bus, BusUnavailable, RecordTooLarge, ensure_topics
from rlnode.bus.localbroker import LocalBroker, free_port
from rlnode.bus.settings import KafkaSettings
from rlnode.bus.signing import RecordVerifier
from rlnode.messages import (
    DeadLetter,
    JobEvent,
    JobEventType,
    JobRequest,
    RolloutWork,
    Trajectory,
    topics,
)
from rlnode.messages.codec import decode, encode
from rlnode.messages.examples import example_payloads
from rlnode.service.auth import VaultTokenVerifier
from rlnode.testing import unique_id, waiting_for
from tests.conftest import eventually, next_matching

pytestmark = pytest.mark.asyncio


def _queue_handler(queue: asyncio.Queue):
    async def handle(message, delivery) -> None:
        await queue.put((message, delivery))

    return handle


async def _publish_seqs(bus: Bus, job_id: str, seqs) -> None:
    for seq in seqs:
        await bus.publish(
            JobEvent(
                job_id=job_id, org_id="o", type=JobEventType.QUEUED, source="t", data={"seq": seq}
            )
        )


async def test_every_message_type_round_trips(make_bus) -> None:
    job_id, org_id = unique_id("job"), unique_id("org")
    sent = example_payloads(job_id, org_id)
    bus = make_bus("roundtrip")
    received: dict[str, asyncio.Queue] = {t: asyncio.Queue() for t in topics.ALL_TOPICS}
    # Group-less readers: group behaviour has tests of its own, and six group joins are slow.
    # A group-less reader's consumer takes the options given (the generator's weight
    # versions poll as the rollout path does).
    poll = {topics.WEIGHT_VERSIONS: {"fetch_max_wait_ms": 20}}
    subscriptions = {
        topic: bus.subscribe(
            topic, _queue_handler(received[topic]), group_id=None, **poll.get(topic, {})
        )
        for topic in topics.ALL_TOPICS
    }
    await bus.start()
    readers = {topic: s._reader for topic, s in subscriptions.items()}
    assert readers[topics.WEIGHT_VERSIONS].consumer._fetch_max_wait_ms == 20  # type: ignore[union-attr]
    assert readers[topics.JOB_EVENTS].consumer._fetch_max_wait_ms == bus.settings.fetch_max_wait_ms  # type: ignore[union-attr]
    for message in sent:
        await bus.publish(message)
    for message in sent:
        topic = next(t for t in topics.ALL_TOPICS if isinstance(message, topics.payload_type(t)))
        got, delivery = await next_matching(
            received[topic], lambda item, m=message: item[0].id == m.id
        )
        assert got == message
        assert type(got) is type(message)
        # Keyed by job; rollout work by job and group (it spreads over the generators).
        key = f"{job_id}/{message.group_id}" if isinstance(message, RolloutWork) else job_id
        assert delivery.key == key.encode()


async def test_malformed_records_are_dead_lettered_and_the_partition_moves_on(
    make_bus, kafka_settings
) -> None:
    job_id, org_id = unique_id("job"), unique_id("org")
    key = job_id.encode()
    bus = make_bus("learner-test")
    good: asyncio.Queue = asyncio.Queue()
    letters: asyncio.Queue = asyncio.Queue()
    events: asyncio.Queue = asyncio.Queue()
    bus.subscribe(topics.JOB_REQUESTS, _queue_handler(good), group_id=unique_id("learner"))
    bus.subscribe(topics.DEAD_LETTERS, _queue_handler(letters), group_id=None)
    bus.subscribe(topics.JOB_EVENTS, _queue_handler(events), group_id=None)
    await bus.start()

    producer = AIOKafkaProducer(bootstrap_servers=kafka_settings.bootstrap_servers)
    await producer.start()
    try:
        # Same key, so all three land on one partition, in this order.
        not_json = await producer.send_and_wait(
            topics.JOB_REQUESTS, b"{definitely not json", key=key
        )
        wrong_shape = orjson.dumps(
            {
                "schema": "rlnode.JobRequest/1",
                "job_id": job_id,
                "org_id": org_id,
                "token": "t",
                "action": "launch",
            }
        )
        shape = await producer.send_and_wait(topics.JOB_REQUESTS, wrong_shape, key=key)
        cancel = JobRequest(job_id=job_id, org_id=org_id, token="t", action="cancel")
        ok = await producer.send_and_wait(topics.JOB_REQUESTS, encode(cancel), key=key)
    finally:
        await producer.stop()
    assert not_json.partition == shape.partition == ok.partition

    got, delivery = await next_matching(good, lambda item: item[0].job_id == job_id)
    assert got == cancel and delivery.offset == ok.offset

    # Dead letters are keyed like the records they carry: both arrive, in order.
    first, _ = await next_matching(letters, lambda item: item[0].key == job_id)
    second, _ = await next_matching(letters, lambda item: item[0].key == job_id)
    assert (first.offset, second.offset) == (not_json.offset, shape.offset)
    assert isinstance(first, DeadLetter)
    assert first.error == "decode" and "not valid JSON" in first.reason
    assert base64.b64decode(first.payload_b64) == b"{definitely not json"
    assert first.source_topic == topics.JOB_REQUESTS and first.consumer == "learner-test"
    assert first.job_id is None  # it named no job that could be read

    assert second.error == "validation"
    assert "action" in second.reason and "launch" in second.reason
    assert second.job_id == job_id and second.org_id == org_id

    # The job the bad request named is told why it was rejected.
    event, _ = await next_matching(events, lambda item: item[0].job_id == job_id)
    assert event.type is JobEventType.REJECTED
    assert event.data["dead_letter_id"] == str(second.id)
    assert "action" in event.data["reason"]


async def test_a_failing_handler_dead_letters_the_record_and_goes_on(make_bus) -> None:
    job_id = unique_id("job")
    bus = make_bus("flaky")
    seen: asyncio.Queue = asyncio.Queue()
    letters: asyncio.Queue = asyncio.Queue()

    async def handler(event: JobEvent, delivery) -> None:
        if event.message == "explode":
            raise RuntimeError("handler bug")
        await seen.put(event)

    bus.subscribe(topics.JOB_EVENTS, handler, group_id=unique_id("g"))
    bus.subscribe(topics.DEAD_LETTERS, _queue_handler(letters), group_id=None)
    await bus.start()
    for text in ("explode", "fine"):
        await bus.publish(
            JobEvent(job_id=job_id, org_id="o", type=JobEventType.QUEUED, source="t", message=text)
        )
    after = await next_matching(seen, lambda e: e.job_id == job_id)
    assert after.message == "fine"
    letter, _ = await next_matching(letters, lambda item: item[0].job_id == job_id)
    assert letter.error == "handler" and "RuntimeError: handler bug" in letter.reason


async def test_per_job_order_holds_across_partitions(make_bus, kafka_settings) -> None:
    bus = make_bus("ordering")
    topic_settings = kafka_settings
    jobs = [unique_id(f"job{i}") for i in range(8)]
    per_job = 25
    received: dict[str, list[int]] = {j: [] for j in jobs}
    done = asyncio.Event()
    partitions: dict[str, set[int]] = {j: set() for j in jobs}

    async def handler(event: JobEvent, delivery) -> None:
        if event.job_id in received:
            received[event.job_id].append(event.data["seq"])
            partitions[event.job_id].add(delivery.partition)
            if all(len(v) == per_job for v in received.values()):
                done.set()

    bus.subscribe(topics.JOB_EVENTS, handler, group_id=unique_id("g"))
    await bus.start()
    # Interleave the jobs, and send each round concurrently: order must still hold per job.
    for seq in range(per_job):
        await asyncio.gather(
            *(
                bus.publish(
                    JobEvent(
                        job_id=j,
                        org_id="o",
                        type=JobEventType.QUEUED,
                        source="t",
                        data={"seq": seq},
                    )
                )
                for j in jobs
            )
        )
    async with waiting_for(
        "every job's records", 60, lambda: {j: len(r) for j, r in received.items()}
    ):
        await done.wait()
    for job in jobs:
        assert received[job] == list(range(per_job)), job
        assert len(partitions[job]) == 1, "a job's records must stay in one partition"
    used = set().union(*partitions.values())
    assert len(used) > 1, "8 jobs over 3 partitions should use more than one"
    assert topic_settings.partitions == 3


async def test_publish_all_keeps_the_order_and_stops_at_an_oversized_record(
    make_bus, kafka_settings
) -> None:
    job_id = unique_id("job")
    small = KafkaSettings(
        bootstrap_servers=kafka_settings.bootstrap_servers, max_message_bytes=1024 * 1024
    )
    bus = make_bus("batch", small)
    got: asyncio.Queue = asyncio.Queue()
    bus.subscribe(topics.JOB_EVENTS, _queue_handler(got), group_id=None)
    await bus.start()

    def event(seq: int, padding: int = 0) -> JobEvent:
        return JobEvent(
            job_id=job_id,
            org_id="o",
            type=JobEventType.QUEUED,
            source="t",
            data={"seq": seq, "padding": "x" * padding},
        )

    published = await bus.publish_all([event(seq) for seq in range(200)])
    assert len({p.partition for p in published}) == 1
    offsets = [p.offset for p in published]
    assert offsets == list(range(offsets[0], offsets[0] + 200))
    for seq in range(200):
        received, delivery = await next_matching(got, lambda item: item[0].job_id == job_id)
        assert (received.data["seq"], delivery.offset) == (seq, offsets[seq])

    # The records before the oversized one are published (as publishing in turn would);
    # none after it.
    with pytest.raises(RecordTooLarge, match=r"does not fit rlnode.job-events"):
        await bus.publish_all([event(200), event(201, padding=5_000_000), event(202)])
    received, _ = await next_matching(got, lambda item: item[0].job_id == job_id)
    assert received.data["seq"] == 200
    await bus.publish(event(203))
    received, _ = await next_matching(got, lambda item: item[0].job_id == job_id)
    assert received.data["seq"] == 203


async def test_topics_are_created_with_the_partition_count(make_bus, kafka_settings) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    bus = make_bus("admin")
    name = unique_id("rlnode.scratch")
    assert await bus.ensure_topics((name,), partitions=5) == [name]
    assert await bus.ensure_topics((name,), partitions=5) == []  # idempotent
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_settings.bootstrap_servers)
    await admin.start()
    try:
        (description,) = await admin.describe_topics([name])
    finally:
        await admin.close()
    assert len(description["partitions"]) == 5


async def test_committed_offsets_survive_a_consumer_restart(make_bus) -> None:
    job_id, group = unique_id("job"), unique_id("g")

    async def consume_until(count_or_quiet: int) -> list[int]:
        bus = make_bus("restart")
        got: asyncio.Queue = asyncio.Queue()
        bus.subscribe(topics.JOB_EVENTS, _queue_handler(got), group_id=group)
        await bus.start()
        seqs = []
        for _ in range(count_or_quiet):
            event, _ = await next_matching(got, lambda item: item[0].job_id == job_id)
            seqs.append(event.data["seq"])
        await bus.stop()
        return seqs

    producer = make_bus("producer")
    await producer.start()
    await _publish_seqs(producer, job_id, range(3))
    assert await consume_until(3) == [0, 1, 2]
    await _publish_seqs(producer, job_id, range(3, 5))
    # A new consumer in the same group starts after what was committed: nothing twice.
    assert await consume_until(2) == [3, 4]


async def test_a_consuming_loop_that_dies_is_reported_and_started_again(make_bus) -> None:
    """A fault in the loop itself (here the offset ledger refuses once, as a locked database
    or a refused commit would) is no silent end of consumption: the bus reports it while the
    loop is down, starts it again, and every record is still handled."""
    job_id, group = unique_id("job"), unique_id("g")
    bus = make_bus("fragile")
    got: asyncio.Queue = asyncio.Queue()
    subscription = bus.subscribe(topics.JOB_EVENTS, _queue_handler(got), group_id=group)
    track = subscription.ledger.track
    failures_seen: list[dict[str, str]] = []

    def fail_once(*args) -> None:
        subscription.ledger.track = track  # type: ignore[method-assign]
        raise RuntimeError("the ledger refused")

    subscription.ledger.track = fail_once  # type: ignore[method-assign]
    await bus.start()
    await subscription.wait_assigned()
    producer = make_bus("producer")
    await producer.start()
    await _publish_seqs(producer, job_id, range(4))
    while not failures_seen:
        if bus.failures():
            failures_seen.append(bus.failures())
        await asyncio.sleep(0.01)
    assert failures_seen[0] == {
        f"consuming {topics.JOB_EVENTS}": "RuntimeError: the ledger refused"
    }
    seqs = []
    while len(seqs) < 4:
        event, _ = await next_matching(got, lambda item: item[0].job_id == job_id)
        seqs.append(event.data["seq"])
    assert sorted(set(seqs)) == [0, 1, 2, 3]
    assert subscription.restarts == 1 and bus.failures() == {}


async def test_only_the_settled_prefix_is_committed(make_bus) -> None:
    """commit="when_settled": a record whose effect is not durable yet holds back the ones
    after it; a consumer that restarts reads again from the first unsettled one."""
    job_id, group = unique_id("job"), unique_id("g")
    producer = make_bus("producer")
    await producer.start()
    await _publish_seqs(producer, job_id, range(4))

    async def run(durable: set[int], want: int) -> list[int]:
        bus = make_bus("settle")
        got: asyncio.Queue = asyncio.Queue()

        async def handler(event: JobEvent, _delivery) -> None:
            if event.job_id == job_id:
                await got.put(event.data["seq"])

        bus.subscribe(
            topics.JOB_EVENTS,
            handler,
            group_id=group,
            commit="when_settled",
            tag=lambda e: e.data.get("seq", -1) if e.job_id == job_id else -1,
            settled=lambda seq: seq == -1 or seq in durable,  # -1: other tests' events
        )
        await bus.start()
        seqs = [await asyncio.wait_for(got.get(), 30) for _ in range(want)]
        await bus.stop()  # commits the settled prefix
        return seqs

    assert await run(durable={0, 2}, want=4) == [0, 1, 2, 3]  # 1 holds 2 back
    assert await run(durable={1, 2, 3}, want=3) == [1, 2, 3]  # from the first unsettled
    await _publish_seqs(producer, job_id, [4])
    assert await run(durable={4}, want=1) == [4]  # 1..3 were committed


async def test_a_record_is_committed_past_only_once_its_dead_letter_is_acknowledged(
    caplog, tmp_path
) -> None:
    """On a broker of its own that the test freezes (SIGSTOP) while the dead letter is being
    published: the record stays unsettled while the publish fails, and is committed past
    only once the broker has the dead letter."""
    caplog.set_level(logging.ERROR, logger="rlnode.bus")
    with LocalBroker(tmp_path / "kafka") as broker:
        settings = KafkaSettings(
            bootstrap_servers=broker.bootstrap_servers,
            request_timeout_ms=1000,
            delivery_timeout_ms=1000,
            session_timeout_ms=6000,
            heartbeat_interval_ms=2000,
        )
        await ensure_topics(settings)
        job_id, group = unique_id("job"), unique_id("g")
        bus = Bus(settings, service="frozen")
        reached, go_on = asyncio.Event(), asyncio.Event()

        async def handler(event: JobEvent, _delivery) -> None:
            reached.set()
            await go_on.wait()
            raise RuntimeError("handler bug")

        # A publish gives up on the frozen broker after 1 s; the consumer's requests
        # (its group join among them) have longer.
        subscription = bus.subscribe(
            topics.JOB_EVENTS, handler, group_id=group, request_timeout_ms=20_000
        )
        await bus.start()
        try:
            # The record itself, from a producer with time to spare: on a loaded machine a
            # fresh broker's first acknowledgement (the producer's id, the new topic's
            # leaders) took longer than the 1 s the dead letter gets.
            patient = settings.model_copy(
                update={"request_timeout_ms": 30_000, "delivery_timeout_ms": 60_000}
            )
            async with Bus(patient, service="writer") as writer:
                published = await writer.publish(
                    JobEvent(job_id=job_id, org_id="o", type=JobEventType.QUEUED, source="t")
                )
            await asyncio.wait_for(reached.wait(), 30)
            partition = TopicPartition(topics.JOB_EVENTS, published.partition)
            os.kill(broker.pid, signal.SIGSTOP)
            try:
                go_on.set()
                await eventually(
                    lambda: "could not publish a dead letter" in caplog.text,
                    30,
                    "the dead letter's publish failed (and is retried)",
                )
                assert subscription.ledger.open == 1
                assert subscription.ledger.committable() == {}
            finally:
                os.kill(broker.pid, signal.SIGCONT)
            await eventually(
                lambda: subscription.ledger.open == 0, 60, "the retry went through: settled"
            )
            await subscription.commit()
            async with bus.reader(topics.DEAD_LETTERS, key=job_id) as reader:
                letters = [
                    decode(r.value, DeadLetter)
                    for r in await reader.fetch(timeout_ms=5000)
                    if r.key == job_id.encode()
                ]
            # One dead letter (one id); a publish that timed out may have reached the broker
            # too, so it can be there twice: at least once, never lost.
            assert {(d.id, d.error, d.offset) for d in letters} == {
                (letters[0].id, "handler", published.offset)
            }
            committed = await _committed(settings, group, partition)
            assert committed == published.offset + 1
        finally:
            await bus.stop()


async def _committed(settings: KafkaSettings, group: str, partition: TopicPartition) -> int | None:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.bootstrap_servers, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        return await consumer.committed(partition)
    finally:
        await consumer.stop()


async def test_an_oversized_record_is_refused_with_the_limit(make_bus, kafka_settings) -> None:
    small = KafkaSettings(
        bootstrap_servers=kafka_settings.bootstrap_servers, max_message_bytes=1024 * 1024
    )
    bus = make_bus("big", small)
    await bus.start()
    ok = next(
        m
        for m in example_payloads(unique_id("job"), "o")
        if isinstance(m, Trajectory) and m.status == "ok"
    )
    turn = ok.turns[0].model_copy(
        update={"completion_ids": [7] * 1_000_000, "logprobs": [-0.5] * 1_000_000}
    )
    huge = ok.model_copy(update={"turns": [turn]})
    with pytest.raises(
        RecordTooLarge, match=r"does not fit rlnode.trajectories \(limit 4,194,304 bytes\)"
    ):
        await bus.publish(huge)


async def test_a_long_episode_fits_after_compression(make_bus) -> None:
    """A 200k-token episode (ids + logprobs, ~3 MB of JSON) goes through whole."""
    job_id = unique_id("job")
    bus = make_bus("long")
    got: asyncio.Queue = asyncio.Queue()
    bus.subscribe(topics.TRAJECTORIES, _queue_handler(got), group_id=unique_id("g"))
    await bus.start()
    ok = next(
        m for m in example_payloads(job_id, "o") if isinstance(m, Trajectory) and m.status == "ok"
    )
    turns = [
        ok.turns[0].model_copy(
            update={
                "completion_ids": [(i * 7919 + t) % 32000 for i in range(20_000)],
                "logprobs": [-(i % 97) / 13 for i in range(20_000)],
            }
        )
        for t in range(10)
    ]
    long = ok.model_copy(update={"turns": turns})
    assert len(encode(long)) > 2_000_000
    await bus.publish(long)
    received, _ = await next_matching(got, lambda item: item[0].id == long.id, within_s=60)
    assert received == long


async def test_an_unreachable_broker_is_reported_clearly() -> None:
    settings = KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}", request_timeout_ms=2000)
    bus = Bus(settings, service="nowhere")
    with pytest.raises(
        BusUnavailable, match=r"cannot reach Kafka at 127.0.0.1:.*KAFKA_BOOTSTRAP_SERVERS"
    ):
        await bus.start()
    with pytest.raises(BusUnavailable, match="cannot reach Kafka"):
        await bus.ensure_topics()


async def test_a_stop_does_not_wait_for_records_whose_producer_cannot_be_checked(
    make_bus, kafka_settings
) -> None:
    """With the vault out of reach, a signed record waits for its producer's check; a stop
    (even one that lets records in flight drain for minutes) does not wait for it: it was not
    begun, and stays uncommitted for the group to read again."""
    job_id, group = unique_id("job"), unique_id("g")
    producer = AIOKafkaProducer(bootstrap_servers=kafka_settings.bootstrap_servers)
    await producer.start()
    try:
        await producer.send_and_wait(
            topics.JOB_EVENTS,
            encode(JobEvent(job_id=job_id, org_id="o", type=JobEventType.QUEUED, source="t")),
            key=job_id.encode(),
            headers=[("rlnode-cert", b"rlc1.e30.AAAA"), ("rlnode-sig", b"\0" * 64)],
        )
    finally:
        await producer.stop()
    nowhere = RecordVerifier(VaultTokenVerifier(f"http://127.0.0.1:{free_port()}"))
    bus = make_bus("checking", verifier=nowhere)
    handled: list[JobEvent] = []

    async def handler(event: JobEvent, _delivery) -> None:
        handled.append(event)

    subscription = bus.subscribe(topics.JOB_EVENTS, handler, group_id=group, concurrency=4)
    await bus.start()
    await eventually(lambda: subscription.in_flight > 0, 60, "a record waiting for its check")
    await asyncio.wait_for(bus.stop(drain_timeout_s=600), 60)
    assert handled == [] and subscription.ledger.committable() == {}


async def test_a_reader_cancelled_while_it_starts_leaves_no_consumer_open(
    kafka_settings, caplog
) -> None:
    """An event stream whose HTTP client goes away cancels its reader wherever it is in its
    start (the partitions, the consumer's start, the seek): nothing stays open."""
    import gc

    from rlnode.bus import TopicReader

    gc.collect()  # what earlier tests of this process left for the collector is theirs
    caplog.set_level(logging.ERROR, logger="asyncio")
    caplog.clear()
    for delay in (0.0, 0.005, 0.02, 0.05, 0.1, 0.2, 0.4):
        reader = TopicReader(kafka_settings, topics.JOB_EVENTS, service="cancelled", key="j")
        starting = asyncio.create_task(reader.start())
        await asyncio.sleep(delay)
        starting.cancel()
        try:
            await starting
        except asyncio.CancelledError:
            pass
        else:  # it had started: a stop closes it
            await reader.stop()
        assert reader._consumer is None, delay
    gc.collect()
    await asyncio.sleep(0)
    assert "Unclosed" not in caplog.text, caplog.text
