"""The SDK's futures: every call that takes time answers with a request id at once, and the
client long-polls `retrieve_future` until the result (or an error with its category) is
there. Results are kept in memory for `result_ttl_s`; each is its org's."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class Answer:
    """What retrieve_future sends back: JSON, or protobuf bytes."""

    body: bytes
    media_type: str = "application/json"

    @classmethod
    def json(cls, content: Any) -> Answer:
        return cls(orjson.dumps(content))

    @classmethod
    def error(cls, message: str, category: str) -> Answer:
        return cls.json({"error": message, "category": category})


@dataclass
class Future:
    org_id: str
    kind: str  # what the client asked (create_model, forward_backward, ...)
    context: dict[str, Any] = field(default_factory=dict)
    answer: Answer | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    finished_at: float | None = None


class Futures:
    def __init__(self, result_ttl_s: float = 3600.0) -> None:
        self.result_ttl_s = result_ttl_s
        self._futures: dict[str, Future] = {}

    def open(self, org_id: str, kind: str, **context: Any) -> tuple[str, Future]:
        self._forget_old()
        request_id = str(uuid.uuid4())
        future = self._futures[request_id] = Future(org_id, kind, context)
        return request_id, future

    def get(self, request_id: str) -> Future | None:
        return self._futures.get(request_id)

    def resolve(self, request_id: str, answer: Answer) -> bool:
        """Give the future its answer; False when it has one already (a result sent twice:
        the first stands) or is unknown (another instance's, or forgotten)."""
        future = self._futures.get(request_id)
        if future is None or future.answer is not None:
            return False
        future.answer = answer
        future.finished_at = time.monotonic()
        future.done.set()
        return True

    async def wait(self, future: Future, timeout_s: float) -> Answer | None:
        """The answer, or None if it did not come within `timeout_s`."""
        if future.answer is None:
            try:
                await asyncio.wait_for(future.done.wait(), timeout_s)
            except TimeoutError:
                return None
        return future.answer

    def pending(self) -> int:
        return sum(1 for f in self._futures.values() if f.answer is None)

    def _forget_old(self) -> None:
        horizon = time.monotonic() - self.result_ttl_s
        old = [
            k
            for k, f in self._futures.items()
            if f.finished_at is not None and f.finished_at < horizon
        ]
        for key in old:
            del self._futures[key]
