"""What can go wrong on the bus, in words that say what to do."""

from __future__ import annotations


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


def unreachable(bootstrap_servers: str, error: BaseException | str) -> BusUnavailable:
    return BusUnavailable(
        f"cannot reach Kafka at {bootstrap_servers} ({error}); start a broker "
        "(`rlnode broker`) or set KAFKA_BOOTSTRAP_SERVERS to one that runs"
    )


class Retryable(Exception):
    """Raised by a handler whose failure will pass (its database is down, a service it asks
    answers 503): the subscription handles the record again after a pause, in place (its
    partition waits, so order is kept), instead of dead-lettering it. A handler that raises
    it must be safe to run again on the same record."""
