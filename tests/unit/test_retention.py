"""Retention on the embedded broker's durable storage: which of a partition's batches go
(the policy, on hand-made batches), and the sweep over objects laid out as Tansu 0.6 lays
them out (topics' configs in meta.json, committed offsets per group and partition)."""

from __future__ import annotations

import json
import time

import pytest

from rlnode.bus.objectstore.files import ObjectFiles
from rlnode.bus.objectstore.retention import Batch, Retention, RetentionSweeper, expired
from rlnode.messages import topics

NOW = 1_000_000.0


def batches(*sizes_and_ages: tuple[int, float]) -> list[Batch]:
    """One-record batches at offsets 0, 1, ..., each (size, seconds old)."""
    return [Batch(i, size, NOW - age) for i, (size, age) in enumerate(sizes_and_ages)]


def offsets(gone: list[Batch]) -> list[int]:
    return [b.offset for b in gone]


def test_kafka_configs_read_as_kafka_reads_them() -> None:
    assert Retention.from_configs({}) == Retention(max_bytes=None, max_age_s=7 * 24 * 3600)
    assert Retention.from_configs({"retention.ms": "-1", "retention.bytes": "-1"}) == Retention(
        None, None
    )
    assert Retention.from_configs({"retention.ms": "1500", "retention.bytes": "10"}) == Retention(
        10, 1.5
    )
    made = topics.RETENTION[topics.JOB_EVENTS].kafka_configs()
    assert Retention.from_configs(made) == Retention(32 * 2**20, 7 * 24 * 3600)


def test_bytes_and_age_bounds_take_the_oldest_first_and_never_the_newest() -> None:
    ten = batches(*[(100, 5.0)] * 10)
    assert offsets(expired(ten, Retention(max_bytes=450, max_age_s=None), NOW)) == [
        0,
        1,
        2,
        3,
        4,
        5,
    ]
    assert expired(ten, Retention(max_bytes=1000, max_age_s=None), NOW) == []
    # Older than the bound: all but the newest, which keeps the partition's end listed.
    assert offsets(expired(ten, Retention(None, max_age_s=1.0), NOW)) == list(range(9))
    mixed = batches((100, 50.0), (100, 40.0), (100, 2.0), (100, 1.0))
    assert offsets(expired(mixed, Retention(None, max_age_s=10.0), NOW)) == [0, 1]
    assert expired([], Retention(0, 0.0), NOW) == []


def test_a_group_that_has_yet_to_read_a_batch_keeps_it_past_every_bound() -> None:
    ten = batches(*[(100, 500.0)] * 10)
    bound = Retention(max_bytes=100, max_age_s=1.0)
    # The group has read offsets 0..3: 0..3 can go, 4 on are kept whatever the bounds say.
    assert offsets(expired(ten, bound, NOW, needed_from=4)) == [0, 1, 2, 3]
    assert expired(ten, bound, NOW, needed_from=0) == []
    # A batch of several records (offsets 2..5) goes only once all of them are read.
    wide = [Batch(0, 10, 0.0), Batch(2, 10, 0.0), Batch(6, 10, 0.0), Batch(7, 10, 0.0)]
    assert offsets(expired(wide, Retention(0, None), NOW, needed_from=5)) == [0]
    assert offsets(expired(wide, Retention(0, None), NOW, needed_from=6)) == [0, 2]


def test_once_read_topics_lose_what_their_groups_have_read_once_old_enough() -> None:
    recent = batches((100, 90.0), (100, 70.0), (100, 30.0), (100, 10.0), (100, 1.0))
    unbounded = Retention(None, None)
    assert offsets(expired(recent, unbounded, NOW, needed_from=5, once_read_s=60.0)) == [0, 1]
    assert offsets(expired(recent, unbounded, NOW, needed_from=1, once_read_s=60.0)) == [0]
    # No group holds the partition: nothing is known to be read, only the bounds apply.
    assert expired(recent, unbounded, NOW, needed_from=None, once_read_s=60.0) == []


# -- the sweep over Tansu's objects ---------------------------------------------------------

CLUSTER = "clusters/c1"


class Broker:
    """Objects as Tansu's dynostore writes them, in a real store directory."""

    def __init__(self, files: ObjectFiles, bucket: str = "tansu") -> None:
        self.files, self.bucket = files, bucket
        files.create_bucket(bucket)
        self.topics: dict[str, dict] = {}

    def put(self, key: str, body: bytes) -> None:
        self.files.put(self.bucket, f"{CLUSTER}/{key}", body, {})

    def topic(self, name: str, partitions: int, **configs: str) -> None:
        entries = [{"name": k.replace("_", "."), "value": v} for k, v in configs.items()]
        self.topics[name] = {"id": name, "topic": {"name": name, "configs": entries}}
        self.put("meta.json", json.dumps({"topics": self.topics}).encode())
        for p in range(partitions):
            self.put(f"topics/{name}/partitions/{p:010d}/watermark.json", b"{}")

    def produce(self, topic: str, partition: int, offset: int, size: int = 100) -> None:
        key = f"topics/{topic}/partitions/{partition:010d}/records/{offset:020d}.batch"
        self.put(key, b"x" * size)

    def commit(self, group: str, topic: str, partition: int, offset: int, members: bool) -> None:
        state = {"members": {"m-1": {}} if members else {}}
        self.put(f"groups/consumers/{group}.json", json.dumps(state).encode())
        key = f"groups/consumers/{group}/offsets/{topic}/partitions/{partition:010d}.json"
        self.put(key, json.dumps({"offset": offset, "metadata": ""}).encode())

    def kept(self, topic: str, partition: int) -> list[int]:
        prefix = f"{CLUSTER}/topics/{topic}/partitions/{partition:010d}/records/"
        keys = self.files.walk(self.bucket, prefix, "", group_dirs=False)
        return [int(k[len(prefix) :].removesuffix(".batch")) for k in keys]


@pytest.fixture
def broker(tmp_path) -> Broker:
    return Broker(ObjectFiles(tmp_path / "objects"))


def sweeper(broker: Broker, after_s: float = 0.0, **kwargs) -> RetentionSweeper:
    """A sweeper whose clock runs `after_s` ahead of the files' times."""
    return RetentionSweeper(
        broker.files, broker.bucket, clock=lambda: time.time() + after_s, **kwargs
    )


def test_the_sweep_applies_each_topics_configs_and_each_groups_hold(broker) -> None:
    broker.topic("small", 2, retention_bytes="300", retention_ms="-1")
    broker.topic("forever", 1, retention_bytes="-1", retention_ms="-1")
    for offset in range(10):
        broker.produce("small", 0, offset)
        broker.produce("small", 1, offset)
        broker.produce("forever", 0, offset)
    broker.commit("readers", "small", 1, 2, members=True)  # has read offsets 0 and 1

    swept = sweeper(broker).sweep()

    assert broker.kept("small", 0) == [7, 8, 9]  # 300 bytes
    assert broker.kept("small", 1) == list(range(2, 10))  # the group has yet to read 2 on
    assert broker.kept("forever", 0) == list(range(10))
    assert swept.batches == {("small", 0): 7, ("small", 1): 2}
    assert swept.bytes == 900
    assert sweeper(broker).sweep().total == 0  # nothing more to do


def test_a_groups_hold_lapses_once_it_is_empty_and_idle_for_the_hold(broker) -> None:
    broker.topic("t", 2, retention_bytes="100", retention_ms="-1")
    for offset in range(5):
        broker.produce("t", 0, offset)
        broker.produce("t", 1, offset)
    broker.commit("alive", "t", 0, 1, members=True)
    broker.commit("idle", "t", 1, 2, members=False)

    sweeper(broker, after_s=30.0, group_holds_s=60.0).sweep()
    assert broker.kept("t", 0) == [1, 2, 3, 4]
    assert broker.kept("t", 1) == [2, 3, 4]  # empty, but committed within the hold

    sweeper(broker, after_s=3600.0, group_holds_s=60.0).sweep()
    assert broker.kept("t", 0) == [1, 2, 3, 4]  # members: holds however long ago
    assert broker.kept("t", 1) == [4]  # lapsed: the bytes bound applies


def test_once_read_topics_keep_only_what_is_unread_or_recent(broker) -> None:
    broker.topic("work", 1, retention_bytes="-1", retention_ms="86400000")
    broker.topic("events", 1, retention_bytes="-1", retention_ms="86400000")
    for offset in range(6):
        broker.produce("work", 0, offset)
        broker.produce("events", 0, offset)
    broker.commit("workers", "work", 0, 4, members=True)
    broker.commit("indexer", "events", 0, 6, members=True)

    sweeper(broker).sweep()  # not old enough yet
    assert broker.kept("work", 0) == list(range(6))
    sweeper(broker, after_s=120.0, once_read_s={"work": 60.0}).sweep()
    assert broker.kept("work", 0) == [4, 5]
    assert broker.kept("events", 0) == list(range(6))  # read, but not a once-read topic
