"""Which offsets a consumer group may commit: per partition, the records handed out and
whether each is settled (its effect is durable). The commit position is one past the
contiguous run of settled records from the oldest, so a record still in flight, or not yet
covered by a checkpoint, holds back the ones after it, and a consumer that dies re-reads
from there. Nothing is lost; a record may be read twice.

Rebalance-safe: `forget` drops a revoked partition, and a late `settle` of one of its
offsets (a handler that finished after the revoke) is ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

from aiokafka import TopicPartition

Tag = TypeVar("Tag", bound=Hashable)


class OffsetLedger(Generic[Tag]):
    def __init__(self) -> None:
        # partition -> offset -> tag (None until tagged); insertion order is offset order,
        # because a partition's records are delivered in order.
        self._open: dict[TopicPartition, dict[int, Tag | None]] = {}
        self._settled: dict[TopicPartition, set[int]] = {}
        # tag -> its open records, so `settle_where` asks once per tag (a job's step), not
        # once per record: a learner holds thousands of records between checkpoints.
        self._by_tag: dict[Tag, list[tuple[TopicPartition, int]]] = {}

    def track(self, partition: TopicPartition, offset: int) -> None:
        """A record was handed out; it holds back the commit position until settled."""
        self._open.setdefault(partition, {})[offset] = None
        self._settled.setdefault(partition, set())

    def tag(self, partition: TopicPartition, offset: int, tag: Tag) -> None:
        """Attach what `settle_where` decides on (e.g. the job and step of a trajectory)."""
        offsets = self._open.get(partition)
        if offsets is not None and offset in offsets:
            offsets[offset] = tag
            self._by_tag.setdefault(tag, []).append((partition, offset))

    def settle(self, partition: TopicPartition, offset: int) -> None:
        if offset in self._open.get(partition, {}):
            self._settled[partition].add(offset)

    def settle_where(self, is_settled: Callable[[Tag], bool]) -> None:
        """Settle every tagged open record whose tag `is_settled` says is durable now."""
        for tag in [t for t in self._by_tag if is_settled(t)]:
            for partition, offset in self._by_tag.pop(tag):
                self.settle(partition, offset)

    def committable(self) -> dict[TopicPartition, int]:
        """Per partition whose position advanced: the next offset to read (what Kafka
        commits). The records it covers are forgotten."""
        positions = {}
        for partition, offsets in self._open.items():
            settled = self._settled[partition]
            last = None
            for offset in offsets:
                if offset not in settled:
                    break
                last = offset
            if last is None:
                continue
            for offset in [o for o in offsets if o <= last]:
                del offsets[offset]
                settled.discard(offset)
            positions[partition] = last + 1
        return positions

    def untrack_from(self, partition: TopicPartition, offset: int) -> None:
        """Records from `offset` on were not handed out after all (they will be read again):
        they no longer hold back the commit position, and earlier ones still do."""
        offsets = self._open.get(partition, {})
        for dropped in [o for o in offsets if o >= offset]:
            tag = offsets.pop(dropped)
            self._settled[partition].discard(dropped)
            if tag is not None and tag in self._by_tag:
                self._by_tag[tag] = [r for r in self._by_tag[tag] if r != (partition, dropped)]
                if not self._by_tag[tag]:
                    del self._by_tag[tag]

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        forgotten = set(partitions)
        for partition in forgotten:
            self._open.pop(partition, None)
            self._settled.pop(partition, None)
        for tag, records in list(self._by_tag.items()):
            kept = [(p, o) for p, o in records if p not in forgotten]
            if kept:
                self._by_tag[tag] = kept
            else:
                del self._by_tag[tag]

    @property
    def open(self) -> int:
        """Records handed out and not yet settled."""
        return sum(len(o) - len(self._settled[p]) for p, o in self._open.items())
