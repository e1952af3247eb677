"""The bus: the one way rlnode produces and consumes Kafka records, on aiokafka.

- `Bus`: a process's producer (records keyed by `job_id`, so a job's records stay in order
  in one partition; a step's records in one go) and its subscriptions;
- `Subscription`: decode and validate each record into its model, call a small typed
  handler, dead-letter what cannot be used, bound what is in flight, commit only what is
  settled (`OffsetLedger`);
- `TopicReader`: read a topic from the beginning (or now) until caught up, then follow;
- topic creation, partition lookup, and the embedded broker (`localbroker`).
"""

from rlnode.bus.clients import ensure_topics, partition_for, topic_partitions
from rlnode.bus.core import Bus, Published
from rlnode.bus.errors import BusError, BusUnavailable, RecordTooLarge, Retryable
from rlnode.bus.ledger import OffsetLedger
from rlnode.bus.reader import TopicReader
from rlnode.bus.settings import KafkaSettings
from rlnode.bus.subscription import Delivery, Subscription

__all__ = [
    "Bus",
    "BusError",
    "BusUnavailable",
    "Delivery",
    "KafkaSettings",
    "OffsetLedger",
    "Published",
    "RecordTooLarge",
    "Retryable",
    "Subscription",
    "TopicReader",
    "ensure_topics",
    "partition_for",
    "topic_partitions",
]
