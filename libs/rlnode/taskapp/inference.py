"""The small client a Task App uses to ask the policy for actions: OpenAI-style chat
completions on the inference URL it was given in the rollout request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from rlnode.service.pooled_http import HttpCallError, PooledHttp


class InferenceError(RuntimeError):
    """The inference endpoint failed or answered something that is not a chat completion."""


def chat_completions_url(inference_url: str) -> str:
    """`<inference_url>/v1/chat/completions`, keeping any query string (some trainers route
    by it) and not doubling a path that already ends in it."""
    parts = urlsplit(inference_url)
    path = parts.path.rstrip("/")
    if not path.endswith("/chat/completions"):
        path = path + ("/chat/completions" if path.endswith("/v1") else "/v1/chat/completions")
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, parts.fragment))


@dataclass(frozen=True)
class ChatResult:
    """A reply: its text (the content; "" when it only calls tools), why it ended ("stop",
    "length", "tool_calls"), the OpenAI `tool_calls` it made (when `tools` were offered),
    and the whole response."""

    text: str
    finish_reason: str | None
    raw: dict[str, Any]
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class InferenceClient:
    def __init__(
        self,
        inference_url: str,
        model: str,
        defaults: dict[str, Any] | None = None,
        timeout_s: float = 300.0,
        client: PooledHttp | None = None,
    ) -> None:
        self.url = chat_completions_url(inference_url)
        self.model = model
        self.defaults = {k: v for k, v in (defaults or {}).items() if v is not None}
        self.timeout_s = timeout_s
        # Pass a shared client where many episodes run: a new one opens new connections
        # (and, over TLS, builds an SSL context: ~50 ms of CPU) for every episode.
        self._http = client or PooledHttp()
        self._owns_http = client is None
        self.calls = 0

    async def chat(self, messages: list[dict[str, Any]], **sampling: Any) -> ChatResult:
        """`sampling`: OpenAI chat fields (max_tokens, stop, ...; `tools` and `tool_choice`
        to offer tools, whose calls come back in `tool_calls`)."""
        body = {"model": self.model, "messages": messages, **self.defaults}
        body.update({k: v for k, v in sampling.items() if v is not None})
        try:
            response = await self._http.post(self.url, json=body, timeout_s=self.timeout_s)
        except HttpCallError as e:
            raise InferenceError(f"inference call to {self.url} failed: {e}") from e
        self.calls += 1
        if response.status != 200:
            raise InferenceError(f"inference answered {response.status}: {response.text[:500]}")
        try:
            raw = response.json()
            choice = raw["choices"][0]
            text = choice["message"].get("content") or ""
            tool_calls = list(choice["message"].get("tool_calls") or [])
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise InferenceError(
                f"inference answered something that is not a chat completion: {response.text[:500]}"
            ) from None
        return ChatResult(
            text=text, finish_reason=choice.get("finish_reason"), raw=raw, tool_calls=tool_calls
        )

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()
