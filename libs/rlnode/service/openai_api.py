"""The OpenAI-compatible surface rlnode serves (the generator's per-rollout endpoints and the
checkpoint-server): request models, prompt handling, and the response and stream shapes the
official `openai` client reads."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import orjson
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(BaseModel):
    """OpenAI's chat completion request; fields not listed (seed, user, …) are accepted and
    ignored."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    logprobs: bool = False

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)


def stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def text_content(message: ChatMessage) -> dict[str, Any]:
    """A message with plain-text content (OpenAI content parts: the text ones, joined)."""
    content = message.content
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
    return {"role": message.role, "content": content or ""}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(message: str, kind: str = "invalid_request_error", code: int | None = None):
    """OpenAI's error shape (the `openai` client shows `error.message`); `detail` as well, as
    every rlnode service answers."""
    return {"error": {"message": message, "type": kind, "code": code}, "detail": message}


class Sampled(Protocol):
    """One sampled choice: an engine's GenerationResult, or a generator's recorded turn."""

    # Read-only, so that a narrower type (TokenTurn's Literal finish_reason) matches too.
    @property
    def completion_ids(self) -> list[int]: ...

    @property
    def logprobs(self) -> list[float]: ...

    @property
    def finish_reason(self) -> str: ...


def chat_completion(
    model: str,
    tokenizer: Any,
    prompt_tokens: int,
    sampled: Sequence[Sampled],
    texts: Sequence[str],
    logprobs: bool = False,
) -> dict[str, Any]:
    """A `chat.completion`: one choice per sample, with its text (already cut at stop
    strings) and, when asked, its tokens' logprobs."""
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text},
            "finish_reason": s.finish_reason,
            "logprobs": {"content": _token_logprobs(tokenizer, s)} if logprobs else None,
        }
        for i, (s, text) in enumerate(zip(sampled, texts, strict=True))
    ]
    return _head("chatcmpl", "chat.completion", model) | {
        "choices": choices,
        "usage": usage(prompt_tokens, sum(len(s.completion_ids) for s in sampled)),
    }


def text_completion(
    model: str,
    tokenizer: Any,
    prompt_tokens: int,
    sampled: Sequence[Sampled],
    texts: Sequence[str],
    logprobs: bool = False,
) -> dict[str, Any]:
    """A `text_completion` (the legacy completions route), logprobs in its legacy shape."""
    choices = [
        {
            "index": i,
            "text": text,
            "finish_reason": s.finish_reason,
            "logprobs": _legacy_logprobs(tokenizer, s) if logprobs else None,
        }
        for i, (s, text) in enumerate(zip(sampled, texts, strict=True))
    ]
    return _head("cmpl", "text_completion", model) | {
        "choices": choices,
        "usage": usage(prompt_tokens, sum(len(s.completion_ids) for s in sampled)),
    }


def _head(prefix: str, kind: str, model: str) -> dict[str, Any]:
    """What a response (or every chunk of a stream) starts with."""
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
    }


def _token_logprobs(tokenizer: Any, sampled: Sampled) -> list[dict[str, Any]]:
    tokens = tokenizer.convert_ids_to_tokens(sampled.completion_ids)
    return [
        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
        for t, lp in zip(tokens, sampled.logprobs, strict=True)
    ]


def _legacy_logprobs(tokenizer: Any, sampled: Sampled) -> dict[str, Any]:
    return {
        "tokens": tokenizer.convert_ids_to_tokens(sampled.completion_ids),
        "token_logprobs": sampled.logprobs,
        "top_logprobs": None,
        "text_offset": None,
    }


# -- streaming ---------------------------------------------------------------------------


def _pieces(tokenizer: Any, sampled: Sampled, text: str) -> Iterator[str]:
    """The completion's text token by token (decoding prefixes, so multi-byte characters
    come out whole), ending where the stop-trimmed text ends."""
    sent = ""
    for i in range(1, len(sampled.completion_ids) + 1):
        prefix = tokenizer.decode(sampled.completion_ids[:i], skip_special_tokens=True)
        prefix = prefix[: len(text)]
        if len(prefix) > len(sent) and not prefix.endswith("\ufffd"):
            yield prefix[len(sent) :]
            sent = prefix
    if len(sent) < len(text):
        yield text[len(sent) :]


def chat_chunks(
    model: str, tokenizer: Any, sampled: Sequence[Sampled], texts: Sequence[str]
) -> Iterator[dict[str, Any]]:
    """A chat completion as `chat.completion.chunk`s: a role delta, the text, the finish."""
    head = _head("chatcmpl", "chat.completion.chunk", model)
    for i, (s, text) in enumerate(zip(sampled, texts, strict=True)):
        yield head | {
            "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ]
        }
        for piece in _pieces(tokenizer, s, text):
            yield head | {
                "choices": [{"index": i, "delta": {"content": piece}, "finish_reason": None}]
            }
        yield head | {"choices": [{"index": i, "delta": {}, "finish_reason": s.finish_reason}]}


def completion_chunks(
    model: str, tokenizer: Any, sampled: Sequence[Sampled], texts: Sequence[str]
) -> Iterator[dict[str, Any]]:
    head = _head("cmpl", "text_completion", model)
    for i, (s, text) in enumerate(zip(sampled, texts, strict=True)):
        for piece in _pieces(tokenizer, s, text):
            yield head | {
                "choices": [{"index": i, "text": piece, "finish_reason": None, "logprobs": None}]
            }
        yield head | {
            "choices": [
                {"index": i, "text": "", "finish_reason": s.finish_reason, "logprobs": None}
            ]
        }


def event_stream(chunks: Iterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events as OpenAI streams them: one `data:` line per chunk, then [DONE].
    The torch engine returns a whole completion, so the stream starts once it is sampled
    (vLLM would stream as it samples); clients see the same chunk protocol either way."""

    def lines() -> Iterator[bytes]:
        for chunk in chunks:
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")
