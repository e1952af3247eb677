"""The OpenAI-compatible surface rlnode serves (the generator's per-rollout endpoints and the
checkpoint-server): request models, prompt handling, tool calls, and the response and stream
shapes the official `openai` client reads.

Tool calls follow the Hermes / Qwen2.5 convention vLLM's `hermes` parser reads: `tools` go
to the model's chat template, which shows them to the model; the model calls one by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, parsed back into `tool_calls`.
The text (and so the tokens) sampled stays exactly what the model wrote."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, Literal, Protocol

import orjson
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field


class BadChatRequest(ValueError):
    """A chat request that cannot be rendered as asked (answered with 400, saying why)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: ToolFunction


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False  # a last chunk with the usage and no choices


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
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model, as `tool_choice` says: all of them
        for "auto" (the default), none for "none". "required" and a named function would
        need constrained sampling, which the engines here do not do: refused, saying so."""
        if not self.tools or self.tool_choice == "none":
            return None
        if self.tool_choice not in (None, "auto"):
            raise BadChatRequest(
                f"tool_choice {self.tool_choice!r} is not supported (it needs constrained "
                "sampling): use 'auto', and check the reply's tool_calls"
            )
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


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
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=5)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def text_content(message: ChatMessage) -> dict[str, Any]:
    """A message for a chat template: plain-text content (OpenAI content parts: the text
    ones, joined); an assistant's `tool_calls` with their arguments as objects (as chat
    templates render them); a tool result's `tool_call_id` and `name`."""
    content = message.content
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
    rendered: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.tool_calls:
        rendered["tool_calls"] = [_call_for_template(c) for c in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        rendered["name"] = message.name
    return rendered


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadChatRequest(f"a tool call needs function.name: {str(call)[:200]}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise BadChatRequest(
                f"tool call {function['name']!r}: arguments are not JSON: {arguments[:200]!r}"
            ) from None
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and OpenAI `tool_calls` of a reply written in the Hermes format. A block
    that is not a JSON object with a string `name` is left in the content, as written."""
    calls: list[dict[str, Any]] = []

    def take(match: re.Match[str]) -> str:
        try:
            call = json.loads(match.group(1))
        except ValueError:
            return match.group(0)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return match.group(0)
        arguments = call.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": arguments
                    if isinstance(arguments, str)
                    else json.dumps(arguments, ensure_ascii=False),
                },
            }
        )
        return ""

    content = TOOL_CALL.sub(take, text).strip() if "<tool_call>" in text else text
    return (content or None) if calls else text, calls


def assistant_message(text: str, finish_reason: str, tools: bool) -> tuple[dict[str, Any], str]:
    """The reply's `message` and finish reason: with tools offered, calls the model wrote
    become `tool_calls` (and a stop becomes "tool_calls")."""
    if not tools:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parse_tool_calls(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    finish = "tool_calls" if finish_reason == "stop" else finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, finish


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
    tools: bool = False,
) -> dict[str, Any]:
    """A `chat.completion`: one choice per sample, with its text (already cut at stop
    strings) or, with `tools` offered, the tool calls it wrote, and, when asked, its
    tokens' logprobs."""
    choices = []
    for i, (s, text) in enumerate(zip(sampled, texts, strict=True)):
        message, finish = assistant_message(text, s.finish_reason, tools)
        choices.append(
            {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": {"content": _token_logprobs(tokenizer, s)} if logprobs else None,
            }
        )
    return _head("chatcmpl", "chat.completion", model) | {
        "choices": choices,
        "usage": _usage_of(prompt_tokens, sampled),
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
        "usage": _usage_of(prompt_tokens, sampled),
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
    model: str,
    tokenizer: Any,
    sampled: Sequence[Sampled],
    texts: Sequence[str],
    tools: bool = False,
    prompt_tokens: int | None = None,
) -> Iterator[dict[str, Any]]:
    """A chat completion as `chat.completion.chunk`s: a role delta, the text, the finish;
    a reply with tool calls (tools offered) sends its content, then each call whole. With
    `prompt_tokens` (`stream_options.include_usage`), a last chunk with the usage."""
    head = _head("chatcmpl", "chat.completion.chunk", model)
    for i, (s, text) in enumerate(zip(sampled, texts, strict=True)):
        yield head | {
            "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ]
        }
        message, finish = assistant_message(text, s.finish_reason, tools)
        if "tool_calls" in message:
            if message["content"]:
                delta: dict[str, Any] = {"content": message["content"]}
                yield head | {"choices": [{"index": i, "delta": delta, "finish_reason": None}]}
            for n, call in enumerate(message["tool_calls"]):
                delta = {"tool_calls": [{"index": n, **call}]}
                yield head | {"choices": [{"index": i, "delta": delta, "finish_reason": None}]}
        else:
            for piece in _pieces(tokenizer, s, text):
                yield head | {
                    "choices": [{"index": i, "delta": {"content": piece}, "finish_reason": None}]
                }
        yield head | {"choices": [{"index": i, "delta": {}, "finish_reason": finish}]}
    if prompt_tokens is not None:
        yield head | {"choices": [], "usage": _usage_of(prompt_tokens, sampled)}


def _usage_of(prompt_tokens: int, sampled: Sequence[Sampled]) -> dict[str, int]:
    return usage(prompt_tokens, sum(len(s.completion_ids) for s in sampled))


def completion_chunks(
    model: str,
    tokenizer: Any,
    sampled: Sequence[Sampled],
    texts: Sequence[str],
    prompt_tokens: int | None = None,
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
    if prompt_tokens is not None:
        yield head | {"choices": [], "usage": _usage_of(prompt_tokens, sampled)}


def event_stream(chunks: Iterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events as OpenAI streams them: one `data:` line per chunk, then [DONE].
    The torch engine returns a whole completion, so the stream starts once it is sampled
    (vLLM would stream as it samples); clients see the same chunk protocol either way."""

    def lines() -> Iterator[bytes]:
        for chunk in chunks:
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")
