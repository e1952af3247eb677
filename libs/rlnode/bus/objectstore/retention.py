"""Retention for the embedded broker's durable storage, applied by the store that holds it.

Tansu 0.6's object-store engine (dynostore) keeps every record batch it was given: it
ignores the topics' `retention.ms` and `retention.bytes`, answers DeleteRecords with a panic
(`todo!()`), and lists a partition's every batch on each fetch, so a node's fetches grow
slower with its history. The batches are objects in this store
(`clusters/<c>/topics/<t>/partitions/<p>/records/<offset>.batch`, one per produce), and so
are the topics' configs (`clusters/<c>/meta.json`) and each consumer group's committed
offsets (`clusters/<c>/groups/consumers/<g>/offsets/<t>/partitions/<p>.json`): the sweep
here reads them and deletes a partition's oldest batches the way Kafka deletes old segments,
with one guard Kafka lacks: a batch that a consumer group has yet to read stays (docs/
decisions.md says why). Tansu finds a deleted batch gone on its next listing; ListOffsets'
earliest is then the oldest batch left, and a consumer that asked for less gets the records
from there on.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import pairwise

from rlnode.bus.objectstore.files import ObjectFiles

log = logging.getLogger("objectstore.retention")

# Kafka's defaults where a topic sets nothing: a week, no bound on bytes.
KAFKA_RETENTION_MS = 7 * 24 * 3600 * 1000
# How long a group's committed offset holds records after its last commit, when the group
# has no members: Kafka keeps an empty group's offsets for a week
# (offsets.retention.minutes); after that the group starts again from its reset policy.
GROUP_HOLDS_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Retention:
    """A topic's bounds, per partition as in Kafka; None: unbounded."""

    max_bytes: int | None
    max_age_s: float | None

    @classmethod
    def from_configs(cls, configs: dict[str, str]) -> Retention:
        """From the topic's Kafka configs; -1 means unbounded, absent means Kafka's default."""
        ms = int(configs.get("retention.ms", KAFKA_RETENTION_MS))
        size = int(configs.get("retention.bytes", -1))
        return cls(max_bytes=None if size < 0 else size, max_age_s=None if ms < 0 else ms / 1000)


@dataclass(frozen=True)
class Batch:
    offset: int  # the batch's base offset; it holds the offsets up to the next batch's
    size: int  # bytes as stored
    mtime: float  # when it was written (epoch seconds)


def expired(
    batches: list[Batch],
    retention: Retention,
    now: float,
    needed_from: int | None = None,
    once_read_s: float | None = None,
) -> list[Batch]:
    """The oldest batches of a partition (`batches` in offset order) that can go: while the
    partition holds more than `max_bytes`, or its oldest batch is older than `max_age_s`, or
    (with `once_read_s`) every group holding the partition has read the batch and it is
    older than that. Never the newest batch (the partition's end stays listed), and never a
    batch holding an offset at or after `needed_from`, the lowest offset a consumer group
    has yet to read (None: no group holds the partition)."""
    total = sum(b.size for b in batches)
    gone: list[Batch] = []
    for batch, following in pairwise(batches):
        age = now - batch.mtime
        over = retention.max_bytes is not None and total > retention.max_bytes
        old = retention.max_age_s is not None and age > retention.max_age_s
        read = once_read_s is not None and needed_from is not None and age > once_read_s
        if not (over or old or read):
            break
        if needed_from is not None and following.offset > needed_from:
            break
        gone.append(batch)
        total -= batch.size
    return gone


@dataclass
class Swept:
    """What one sweep deleted: batches and bytes per (topic, partition)."""

    batches: dict[tuple[str, int], int]
    bytes: int

    @property
    def total(self) -> int:
        return sum(self.batches.values())


class RetentionSweeper:
    """Applies every topic's retention to the partitions of every cluster in `bucket`;
    `once_read_s[topic]`: that topic's records go once every group holding their partition
    has read them and they are that old (topics read only through groups: the embedded
    node's work queues, rlnode.messages.topics.RETENTION)."""

    def __init__(
        self,
        files: ObjectFiles,
        bucket: str,
        once_read_s: dict[str, float] | None = None,
        group_holds_s: float = GROUP_HOLDS_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.files = files
        self.bucket = bucket
        self.once_read_s = once_read_s or {}
        self.group_holds_s = group_holds_s
        self.clock = clock

    def sweep(self) -> Swept:
        swept = Swept(batches={}, bytes=0)
        if not self.files.bucket_exists(self.bucket):
            return swept
        for cluster in self._dirs("clusters/"):
            topics = self._topics(cluster)
            if not topics:
                continue
            needed = self._needed(cluster)
            now = self.clock()
            for topic, retention in topics.items():
                for partition in self._partitions(cluster, topic):
                    batches = self._batches(cluster, topic, partition)
                    held = needed.get((topic, partition))
                    gone = expired(batches, retention, now, held, self.once_read_s.get(topic))
                    if not gone:
                        continue
                    for batch in gone:
                        key = _batch_key(cluster, topic, partition, batch)
                        # Not fsync'd one by one: one a crash brings back goes next sweep.
                        self.files.delete(self.bucket, key, durable=False)
                    freed = sum(b.size for b in gone)
                    swept.batches[(topic, partition)] = len(gone)
                    swept.bytes += freed
                    log.info(
                        "retention: %s[%d]: deleted %d batches (%d bytes), offsets %d-%d; "
                        "%d left%s",
                        topic,
                        partition,
                        len(gone),
                        freed,
                        gone[0].offset,
                        batches[len(gone)].offset - 1,
                        len(batches) - len(gone),
                        "" if held is None else f", a group still reads from {held}",
                    )
        return swept

    # -- what the broker keeps, read from its objects --------------------------------------------

    def _dirs(self, prefix: str) -> Iterable[str]:
        """The directory names right below `prefix`."""
        for key in self.files.walk(self.bucket, prefix, "", group_dirs=True):
            if key.endswith("/"):
                yield key[len(prefix) : -1]

    def _json(self, key: str) -> dict | None:
        found = self.files.get(self.bucket, key)
        if found is None:
            return None
        _meta, body = found
        with body:
            try:
                value = json.loads(body.read())
            except ValueError:
                log.warning("retention: %s is not JSON; left alone", key)
                return None
        return value if isinstance(value, dict) else None

    def _topics(self, cluster: str) -> dict[str, Retention]:
        meta = self._json(f"clusters/{cluster}/meta.json") or {}
        topics: dict[str, Retention] = {}
        for name, entry in (meta.get("topics") or {}).items():
            configs = {
                c["name"]: c["value"]
                for c in (entry.get("topic") or {}).get("configs") or []
                if c.get("value") is not None
            }
            try:
                topics[name] = Retention.from_configs(configs)
            except ValueError:
                log.warning(
                    "retention: topic %s has unreadable retention configs %s", name, configs
                )
        return topics

    def _partitions(self, cluster: str, topic: str) -> list[int]:
        return sorted(
            int(name) for name in self._dirs(f"clusters/{cluster}/topics/{topic}/partitions/")
        )

    def _batches(self, cluster: str, topic: str, partition: int) -> list[Batch]:
        prefix = f"clusters/{cluster}/topics/{topic}/partitions/{partition:010d}/records/"
        batches = []
        for key in self.files.walk(self.bucket, prefix, "", group_dirs=False):
            name = key[len(prefix) :]
            meta = self.files.listed(self.bucket, key)
            if meta is None or not name.endswith(".batch"):
                continue
            batches.append(Batch(int(name.removesuffix(".batch")), meta.size, meta.mtime))
        return sorted(batches, key=lambda b: b.offset)

    def _needed(self, cluster: str) -> dict[tuple[str, int], int]:
        """Per (topic, partition), the lowest offset a group still has to read: its
        committed offset, while the group has members or committed within group_holds_s."""
        groups = f"clusters/{cluster}/groups/consumers/"
        needed: dict[tuple[str, int], int] = defaultdict(lambda: 2**63)
        now = self.clock()
        for group in self._dirs(groups):
            live = bool((self._json(f"{groups}{group}.json") or {}).get("members"))
            prefix = f"{groups}{group}/offsets/"
            for key in self.files.walk(self.bucket, prefix, "", group_dirs=False):
                # <topic>/partitions/<partition>.json
                topic, _, name = key[len(prefix) :].rpartition("/partitions/")
                meta = self.files.listed(self.bucket, key)
                if meta is None or not name.endswith(".json"):
                    continue
                if not live and now - meta.mtime > self.group_holds_s:
                    continue
                committed = (self._json(key) or {}).get("offset")
                if isinstance(committed, int) and committed >= 0:
                    slot = (topic, int(name.removesuffix(".json")))
                    needed[slot] = min(needed[slot], committed)
        return dict(needed)


def _batch_key(cluster: str, topic: str, partition: int, batch: Batch) -> str:
    return f"clusters/{cluster}/topics/{topic}/partitions/{partition:010d}/records/{batch.offset:020d}.batch"


def sweep_every(sweeper: RetentionSweeper, interval_s: float) -> threading.Thread:
    """A daemon thread sweeping every `interval_s`; a failed sweep is logged and the next
    one runs."""

    def run() -> None:
        while True:
            time.sleep(interval_s)
            try:
                sweeper.sweep()
            except Exception:
                log.exception("retention: the sweep failed; trying again in %.0f s", interval_s)

    thread = threading.Thread(target=run, name="retention", daemon=True)
    thread.start()
    return thread
