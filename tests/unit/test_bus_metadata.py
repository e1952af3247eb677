"""Metadata requests outlive a dead broker that the metadata still names (the real case:
tests/multihost kills a broker of three; a generator started beside it failed its start on
one unlucky pick). Here a client whose first picks land on that broker."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from aiokafka.errors import ClusterAuthorizationFailedError, NodeNotReadyError

from rlnode.bus import BusUnavailable, KafkaSettings
from rlnode.bus.clients import described_topics

SETTINGS = KafkaSettings(bootstrap_servers="10.0.0.1:9092,10.0.0.2:9092")
TOPICS = [{"topic": "rlnode.job-events", "partitions": [{"partition": 0}]}]


class PicksADeadBrokerFirst:
    """describe_topics as aiokafka's admin client answers it when its random pick is a
    broker that is down (`dead_picks` times), then from a live one."""

    def __init__(self, dead_picks: int, error: Exception | None = None) -> None:
        self.dead_picks = dead_picks
        self.error = error or NodeNotReadyError("node 2 not ready")
        self.calls = 0

    async def describe_topics(self) -> list[dict]:
        self.calls += 1
        if self.calls <= self.dead_picks:
            raise self.error
        return TOPICS


def _described(client: PicksADeadBrokerFirst, retry_s: float) -> list[dict]:
    return asyncio.run(described_topics(cast(Any, client), SETTINGS, retry_s))


def test_a_dead_broker_picked_is_tried_past() -> None:
    client = PicksADeadBrokerFirst(dead_picks=3)
    assert _described(client, retry_s=10) == TOPICS
    assert client.calls == 4


def test_a_cluster_that_stays_unreachable_is_said_so_once_the_retries_are_over() -> None:
    with pytest.raises(BusUnavailable, match=r"cannot reach Kafka at 10\.0\.0\.1:9092"):
        _described(PicksADeadBrokerFirst(dead_picks=1000), retry_s=0.5)


def test_an_error_that_will_not_pass_is_not_retried() -> None:
    client = PicksADeadBrokerFirst(dead_picks=5, error=ClusterAuthorizationFailedError())
    with pytest.raises(BusUnavailable):
        _described(client, retry_s=10)
    assert client.calls == 1
