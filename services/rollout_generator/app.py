"""HTTP wiring of the rollout-generator: the per-rollout OpenAI-compatible endpoints the Task
Apps call, and the lifecycle of the work consumer and the weight follower."""

from __future__ import annotations

import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from rlnode import topics
from rlnode.bus import Bus
from rlnode.http import install_error_handlers
from rlnode.service import create_service_app
from rollout_generator.engines import EnginePool
from rollout_generator.rollouts import (
    InferenceRefused,
    RolloutRegistry,
    RolloutRunner,
    render_prompt,
)
from rollout_generator.settings import SERVICE_NAME, GeneratorSettings
from rollout_generator.weights import WeightSync
from rollout_generator.work import WorkConsumer


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(BaseModel):
    """The OpenAI fields rollouts use; others (logprobs, seed, …) are accepted and ignored.
    Sampling follows the job's config: temperature and top_p here are not honoured, and
    max_tokens can only lower the job's."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _check_supported(n: int, stream: bool) -> None:
    if n != 1:
        raise InferenceRefused(
            400, "n must be 1 on rollout endpoints: each call is one recorded turn"
        )
    if stream:
        raise InferenceRefused(
            400, "streaming is not supported on rollout endpoints; send stream: false"
        )


def _text_content(message: ChatMessage) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
    return {"role": message.role, "content": content or ""}


def create_app(settings: GeneratorSettings) -> FastAPI:
    pool = EnginePool(settings)
    registry = RolloutRegistry()
    bus = Bus(settings.kafka, service=f"rollout-generator/{settings.generator_id}")
    weights = WeightSync(settings, pool, bus)
    runner = RolloutRunner(settings, pool, registry, weights)
    poll_ms = int(
        (settings.drain_timeout_s + 3600) * 1000
    )  # long rollouts must not cost the group membership
    consumer = WorkConsumer(bus, settings.work_group, settings.concurrency, runner.run, poll_ms)
    bus.subscribe(topics.WEIGHT_VERSIONS, weights.on_weight_version, group_id=None, commit="none")

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await bus.start()
        await consumer.start()
        yield
        await consumer.stop(settings.drain_timeout_s)
        await runner.aclose()
        await bus.stop()
        await pool.close()

    app = create_service_app(SERVICE_NAME, settings, lifespan=lifespan)
    app.state.health_checks["service_token"] = lambda: settings.service_token is not None
    install_error_handlers(app)
    app.state.consumer = consumer
    app.state.registry = registry

    @app.exception_handler(InferenceRefused)
    async def _refused(_request: Request, exc: InferenceRefused) -> JSONResponse:
        return JSONResponse(
            status_code=exc.status,
            content={"error": {"message": exc.message, "type": "invalid_request_error"}},
        )

    @app.get("/v1/generator", tags=["ops"])
    async def status() -> dict[str, Any]:
        return {
            "generator": settings.generator_id,
            "rollouts_in_flight": len(registry),
            "trajectories_published": consumer.published,
            "partitions": consumer.partitions,
            "jobs": {job: e.loaded_version for job, e in pool.jobs.items()},
        }

    @app.post("/rollouts/{rollout_id}/v1/chat/completions", tags=["inference"])
    async def chat_completions(rollout_id: str, body: ChatCompletionRequest) -> dict[str, Any]:
        rollout = registry.get(rollout_id)
        _check_supported(body.n, body.stream)
        prompt_ids = render_prompt(rollout.engines, [_text_content(m) for m in body.messages])
        turn, text = await rollout.complete(
            prompt_ids, body.max_completion_tokens or body.max_tokens, _stops(body.stop)
        )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model or rollout.work.job_id,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": turn.finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": _usage(turn),
        }

    @app.post("/rollouts/{rollout_id}/v1/completions", tags=["inference"])
    async def completions(rollout_id: str, body: CompletionRequest) -> dict[str, Any]:
        rollout = registry.get(rollout_id)
        _check_supported(body.n, body.stream)
        if isinstance(body.prompt, str):
            prompt_ids = list(rollout.engines.policy.tokenizer(body.prompt)["input_ids"])
        else:
            prompt_ids = list(body.prompt)
        if not prompt_ids:
            raise InferenceRefused(400, "empty prompt")
        turn, text = await rollout.complete(prompt_ids, body.max_tokens, _stops(body.stop))
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model or rollout.work.job_id,
            "choices": [
                {"index": 0, "text": text, "finish_reason": turn.finish_reason, "logprobs": None}
            ],
            "usage": _usage(turn),
        }

    return app


def _usage(turn) -> dict[str, int]:
    prompt, completion = len(turn.prompt_ids), len(turn.completion_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
