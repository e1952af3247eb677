"""The embedded Tansu broker as a process: starts, serves aiokafka groups, stops, and says
clearly what is wrong when it cannot. On durable storage (rlnode's object store) a broker
killed with SIGKILL and started again has every record and committed offset, and two
brokers on one store are a cluster whose clients go on when one of them dies."""

from __future__ import annotations

import asyncio
import os
import signal
import stat

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import NewTopic

from rlnode.bus import KafkaSettings, TopicReader, clients, ensure_topics
from rlnode.bus.localbroker import BrokerBinaryMissing, BrokerStartError, LocalBroker, find_tansu
from rlnode.bus.objectstore import LocalObjectStore
from rlnode.messages import topics


def test_tansu_comes_from_the_pinned_wheel() -> None:
    path = find_tansu()
    assert os.access(path, os.X_OK)
    assert "tansu" in os.path.basename(path)


def test_a_missing_binary_is_a_clear_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("RLNODE_TANSU_BIN", str(tmp_path / "no-such-tansu"))
    with pytest.raises(BrokerBinaryMissing, match=r"RLNODE_TANSU_BIN=.*not an executable"):
        LocalBroker().start()


def test_a_binary_that_dies_at_start_is_reported_with_its_log(monkeypatch, tmp_path) -> None:
    fake = tmp_path / "tansu"
    fake.write_text("#!/bin/sh\necho 'cannot bind: permission denied' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("RLNODE_TANSU_BIN", str(fake))
    with pytest.raises(BrokerStartError, match=r"exited with code 3(.|\n)*cannot bind"):
        LocalBroker(start_timeout_s=5).start()


def test_start_serve_a_consumer_group_and_stop(tmp_path) -> None:
    broker = LocalBroker(log_path=tmp_path / "tansu.log")
    with broker:
        assert broker.running
        pid = broker.pid

        async def roundtrip() -> bytes:
            producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap_servers)
            consumer = AIOKafkaConsumer(
                "scratch",
                bootstrap_servers=broker.bootstrap_servers,
                group_id="g",
                auto_offset_reset="earliest",
                session_timeout_ms=6000,
                heartbeat_interval_ms=2000,
            )
            await producer.start()
            await producer.send_and_wait("scratch", b"hello", key=b"k")
            await producer.stop()
            await consumer.start()
            try:
                record = await asyncio.wait_for(consumer.getone(), 30)
                await consumer.commit()
                return record.value
            finally:
                await consumer.stop()

        assert asyncio.run(roundtrip()) == b"hello"
    assert not broker.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "listening on" in (tmp_path / "tansu.log").read_text()


# -- durable storage (#28) --------------------------------------------------------------


async def _produce(bootstrap: str, topic: str, values: range) -> None:
    producer = clients.producer(KafkaSettings(bootstrap_servers=bootstrap), "test")
    await producer.start()
    try:
        for i in values:
            await producer.send_and_wait(topic, f"r{i}".encode(), key=b"job")
    finally:
        await producer.stop()


def _reader(bootstrap: str, group: str | None = None) -> AIOKafkaConsumer:
    settings = KafkaSettings(
        bootstrap_servers=bootstrap,
        request_timeout_ms=5000,  # past a dead broker quickly
        session_timeout_ms=6000,  # Tansu holds a first join for half of it
        heartbeat_interval_ms=2000,
    )
    return clients.consumer(settings, "test", group_id=group)


async def _read(consumer: AIOKafkaConsumer, count: int) -> list[str]:
    got: list[str] = []
    while len(got) < count:
        records = await asyncio.wait_for(consumer.getmany(timeout_ms=1000), 30)
        got += [r.value.decode() for batch in records.values() for r in batch]
    return got


def test_a_durable_broker_killed_keeps_every_record_and_committed_offset(tmp_path) -> None:
    broker = LocalBroker(
        storage="durable", data_dir=tmp_path / "store", log_path=tmp_path / "t.log"
    )
    partition = TopicPartition("durable", 0)

    async def before() -> None:
        settings = KafkaSettings(bootstrap_servers=broker.bootstrap_servers)
        await ensure_topics(settings, ["durable"], partitions=1)
        await _produce(broker.bootstrap_servers, "durable", range(20))
        consumer = _reader(broker.bootstrap_servers, "g")
        await consumer.start()
        try:
            consumer.assign([partition])
            assert await _read(consumer, 20) == [f"r{i}" for i in range(20)]
            await consumer.commit({partition: 12})
        finally:
            await consumer.stop()

    async def after() -> tuple[int | None, list[str]]:
        consumer = _reader(broker.bootstrap_servers, "g")
        await consumer.start()
        try:
            consumer.assign([partition])
            committed = await consumer.committed(partition)
            consumer.seek(partition, 0)
            return committed, await _read(consumer, 20)
        finally:
            await consumer.stop()

    with broker:
        asyncio.run(before())
        store = broker.object_store
        assert store is not None and store.pid is not None and broker.pid is not None
        for pid in (broker.pid, store.pid):  # a crash of both: nothing stops in order
            os.kill(pid, signal.SIGKILL)
        broker.stop()
        broker.start()
        committed, records = asyncio.run(after())
    assert committed == 12
    assert records == [f"r{i}" for i in range(20)]


def test_two_brokers_on_one_store_are_a_cluster_that_survives_one(tmp_path) -> None:
    with LocalObjectStore(tmp_path / "store", log_path=tmp_path / "store.log") as store:
        a, b = (
            LocalBroker(
                storage="durable",
                object_store=store,
                cluster_id="pair",
                log_path=tmp_path / f"{name}.log",
            )
            for name in "ab"
        )
        both = f"{a.bootstrap_servers},{b.bootstrap_servers}"

        async def run() -> tuple[list[str], list[str], int]:
            await _produce(a.bootstrap_servers, "pair", range(5))
            # Clients that know both, started while only A is up (aiokafka picks a
            # bootstrap server at random): they work through A.
            producer = clients.producer(KafkaSettings(bootstrap_servers=both), "test")
            consumer = _reader(both, "pair-group")
            await producer.start()
            await consumer.start()
            try:
                consumer.subscribe(["pair"])
                got = await _read(consumer, 5)
                await consumer.commit()
                b.start()
                through_b = _reader(b.bootstrap_servers)
                await through_b.start()
                try:
                    through_b.subscribe(["pair"])
                    seen_by_b = await _read(through_b, 5)  # what A took in
                finally:
                    await through_b.stop()
                assert a.pid is not None
                os.kill(a.pid, signal.SIGKILL)
                for i in range(5, 10):
                    sent = producer.send_and_wait("pair", f"r{i}".encode(), key=b"job")
                    await asyncio.wait_for(sent, 60)
                got += await _read(consumer, 5)
                await consumer.commit()
            finally:
                await producer.stop()
                await consumer.stop()
            check = _reader(b.bootstrap_servers, "pair-group")
            await check.start()
            try:
                partitions = check.partitions_for_topic("pair") or set()
                committed = [await check.committed(TopicPartition("pair", p)) for p in partitions]
            finally:
                await check.stop()
            return seen_by_b, got, sum(c or 0 for c in committed)

        with a:  # B is started by `run`, once the clients work through A
            try:
                seen_by_b, got, committed = asyncio.run(run())
                assert not a.running and b.running
            finally:
                b.stop()
    assert seen_by_b == [f"r{i}" for i in range(5)]
    assert got == [f"r{i}" for i in range(10)]
    assert committed == 10


def test_a_node_started_again_on_its_data_dir_finds_its_topics(tmp_path) -> None:
    """`rlnode down`, then `rlnode up` on the same data dir: the broker's storage is there."""
    from rlnode.node.local import LocalNode, NodeOptions

    options = NodeOptions(data_dir=tmp_path / "node", services=("credential-vault",))
    with LocalNode(options) as first:
        assert first.broker is not None and first.broker.storage == "durable"
        asyncio.run(_produce(first.bootstrap, topics.JOB_REQUESTS, range(3)))
    with LocalNode(options) as again:

        async def held() -> list[str]:
            async with TopicReader(again.kafka_settings(), topics.JOB_REQUESTS, service="t") as r:
                records: list[str] = []
                while not r.caught_up.is_set():
                    records += [x.value.decode() for x in await r.fetch(timeout_ms=200)]
                return records

        assert asyncio.run(held()) == ["r0", "r1", "r2"]
    assert (tmp_path / "node" / "secrets" / "objectstore.json").stat().st_mode & 0o077 == 0


# -- retention on durable storage (#36) -------------------------------------------------


def test_retention_drops_old_records_but_never_what_a_group_has_yet_to_read(tmp_path) -> None:
    """Tansu 0.6 keeps every batch; the store deletes a partition's oldest ones by the
    topic's own retention configs and by what its groups have read (a once-read topic),
    keeping the unread. Consumers read on across the deletions, from the first batch
    left; offsets go on from where they were."""
    store = LocalObjectStore(tmp_path / "store", retention_every_s=0.2, once_read_s={"queue": 0.5})
    bounded, queue = TopicPartition("bounded", 0), TopicPartition("queue", 0)

    async def earliest(partition: TopicPartition, want: int) -> int:
        consumer = _reader(broker.bootstrap_servers)
        await consumer.start()
        try:
            for _ in range(100):
                first = (await consumer.beginning_offsets([partition]))[partition]
                if first == want:
                    return first
                await asyncio.sleep(0.1)
            return first
        finally:
            await consumer.stop()

    async def read_from_earliest(partition: TopicPartition, count: int) -> list[str]:
        consumer = _reader(broker.bootstrap_servers)
        await consumer.start()
        try:
            consumer.assign([partition])
            await consumer.seek_to_beginning(partition)
            return await _read(consumer, count)
        finally:
            await consumer.stop()

    async def scenario() -> None:
        settings = KafkaSettings(bootstrap_servers=broker.bootstrap_servers)
        admin = clients.admin(settings)
        await admin.start()
        try:
            await admin.create_topics(
                [
                    NewTopic(
                        "bounded",
                        1,
                        1,
                        topic_configs={"retention.bytes": "1", "retention.ms": "-1"},
                    ),
                    NewTopic("queue", 1, 1, topic_configs={"retention.ms": "86400000"}),
                ]
            )
        finally:
            await admin.close()
        group = _reader(broker.bootstrap_servers, "g")
        await group.start()
        try:
            group.assign([bounded, queue])
            # The group holds both partitions from their start: nothing it is yet to read
            # goes, however far over its bounds the topic is.
            await group.commit({bounded: 0, queue: 0})
            await _produce(broker.bootstrap_servers, "bounded", range(10))
            await _produce(broker.bootstrap_servers, "queue", range(5))
            await asyncio.sleep(0.5)  # sweeps
            group.seek(bounded, 0)
            group.seek(queue, 0)
            assert len(await _read(group, 15)) == 15
            await group.commit({bounded: 4, queue: 3})
            # Over its 1 byte, the bounded topic keeps what the group has yet to read.
            assert await earliest(bounded, 4) == 4
            assert await read_from_earliest(bounded, 6) == [f"r{i}" for i in range(4, 10)]
            # The queue keeps only its unread records, once the read ones are 0.5 s old.
            assert await earliest(queue, 3) == 3
            assert await read_from_earliest(queue, 2) == ["r3", "r4"]
            # Everything read: only the newest batch stays; offsets go on from 10.
            await group.commit({bounded: 10})
            assert await earliest(bounded, 9) == 9
            await _produce(broker.bootstrap_servers, "bounded", range(10, 12))
            assert await _read(group, 2) == ["r10", "r11"]
            assert (await group.end_offsets([bounded]))[bounded] == 12
        finally:
            await group.stop()

    with store, LocalBroker(storage="durable", object_store=store) as broker:
        asyncio.run(scenario())


@pytest.mark.parametrize("storage", ["memory", "durable"])
def test_a_reader_from_a_time_skips_the_history_before_it(tmp_path, storage, monkeypatch) -> None:
    """A job's events are read from when its id was made: the reader seeks by the time
    records were stored (Tansu answers ListOffsets by timestamp), not from the beginning,
    and with nothing stored since then it follows from the end."""
    import time

    from rlnode.sdk.jobs import job_made_at, new_job_id

    async def read(
        settings: KafkaSettings, since: float, then: range
    ) -> tuple[list[str], list[str]]:
        """What the reader finds there, and what it gets of `then`, produced afterwards."""
        async with TopicReader(settings, "history", service="t", since=since) as reader:
            found: list[str] = []
            while not reader.caught_up.is_set():
                found += [r.value.decode() for r in await reader.fetch(timeout_ms=200)]
            await _produce(settings.bootstrap_servers, "history", then)
            followed: list[str] = []
            while len(followed) < len(then):
                followed += [r.value.decode() for r in await reader.fetch(timeout_ms=200)]
            return found, followed

    async def scenario(settings: KafkaSettings) -> None:
        await ensure_topics(settings, ["history"], partitions=1)
        await _produce(settings.bootstrap_servers, "history", range(5))
        await asyncio.sleep(0.3)
        cut = time.time()
        await _produce(settings.bootstrap_servers, "history", range(5, 8))
        assert await read(settings, cut, range(8, 9)) == (["r5", "r6", "r7"], ["r8"])
        assert await read(settings, time.time() + 1, range(9, 10)) == ([], ["r9"])
        # A record stored just after the lookup by time found nothing (a job's verdict as its
        # watcher starts) is read, not skipped by a seek to an end that has moved past it.
        lookup = AIOKafkaConsumer.offsets_for_times

        async def then_a_record(self, *args, **kwargs):
            found = await lookup(self, *args, **kwargs)
            await _produce(settings.bootstrap_servers, "history", range(10, 11))
            return found

        monkeypatch.setattr(AIOKafkaConsumer, "offsets_for_times", then_a_record)
        async with TopicReader(settings, "history", service="t", since=time.time() + 1) as late:
            got: list[str] = []
            for _ in range(10):
                got += [r.value.decode() for r in await late.fetch(timeout_ms=200)]
            assert got == ["r10"]
        monkeypatch.undo()

    with LocalBroker(storage=storage, data_dir=tmp_path / "store") as broker:
        asyncio.run(scenario(KafkaSettings(bootstrap_servers=broker.bootstrap_servers)))
    made = new_job_id()
    assert abs((job_made_at(made) or 0) - time.time()) < 2
    assert job_made_at("job-0123456789ab") is None  # the old form, or the user's own
    assert job_made_at("job-20261399-000000-0123abcd") is None
