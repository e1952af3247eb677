"""The OpenAI-compatible surface rlnode serves (the generator's per-rollout endpoints and the
checkpoint-server): request models, prompt handling, and the response and stream shapes the
official `openai` client reads."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
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


def chat_response(model: str, choices: list[dict[str, Any]], use: dict[str, int]) -> dict:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def completion_response(model: str, choices: list[dict[str, Any]], use: dict[str, int]) -> dict:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }


def sse(chunks: Iterator[dict[str, Any]]) -> Iterator[bytes]:
    """Server-sent events as OpenAI streams them: one `data:` line per chunk, then [DONE]."""
    for chunk in chunks:
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    yield b"data: [DONE]\n\n"
