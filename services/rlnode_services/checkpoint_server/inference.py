"""OpenAI-compatible inference on any checkpoint of your org: `model` is
`"<job_id>@<step>"`, `"<job_id>@latest"` or `"<job_id>@best"`; the official `openai` client
works, tools and tool calls included. Checkpoints load on first use into the LRU cache."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import APIRouter

from rlnode.engine import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    cut_at_stop,
    render_chat,
)
from rlnode.service.auth import Scope, TokenClaims
from rlnode.service.openai_api import (
    BadChatRequest,
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunks,
    chat_completion,
    completion_chunks,
    event_stream,
    stops,
    text_completion,
    text_content,
)
from rlnode_services.checkpoint_server.access import Caller, need, org_of
from rlnode_services.checkpoint_server.models import Checkpoints, ModelCache, ModelProblem
from rlnode_services.checkpoint_server.settings import CheckpointServerSettings

if TYPE_CHECKING:
    from rlnode.engine.torch_engine import TorchEngine


def inference_routes(
    settings: CheckpointServerSettings, checkpoints: Checkpoints, cache: ModelCache
) -> APIRouter:
    router = APIRouter()

    async def _engine_for(claims: TokenClaims, model: str | None) -> tuple[str, TorchEngine]:
        """The model name as asked (`<job>@latest` stays so) and its loaded engine."""
        need(claims, Scope.INFERENCE)
        record, path = checkpoints.resolve(org_of(claims), model)
        return model or record.model, await cache.get(record.model, path)

    async def _sample(engine, prompt_ids: list[int], body, stop: list[str]):
        budget = min(body_budget(body) or settings.default_max_tokens, settings.max_tokens)
        limit = getattr(engine.model.config, "max_position_embeddings", None)
        if limit is not None and len(prompt_ids) + budget > limit:
            raise ModelProblem(
                400,
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({budget}) exceed the "
                f"model's {limit}-token context",
            )
        request = GenerationRequest(
            prompt_ids=prompt_ids,
            max_tokens=budget,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=stop,
        )
        try:
            return await asyncio.gather(*(engine.generate(request) for _ in range(body.n)))
        except EngineError as e:
            raise ModelProblem(400, str(e)) from None

    @router.post("/v1/chat/completions", tags=["inference"])
    async def chat(claims: Caller, body: ChatCompletionRequest):
        model, engine = await _engine_for(claims, body.model)
        try:
            tools = body.template_tools()
            messages = [text_content(m) for m in body.messages]
        except BadChatRequest as e:
            raise ModelProblem(400, str(e)) from None
        try:
            prompt_ids = render_chat(engine.tokenizer, messages, tools)
        except Exception as e:
            raise ModelProblem(
                400, f"cannot apply the chat template to these messages: {e}"
            ) from None
        stop = stops(body.stop)
        results = await _sample(engine, prompt_ids, body, stop)
        texts = [_text(engine, r, stop) for r in results]
        if body.stream:
            usage = len(prompt_ids) if body.include_usage else None
            return event_stream(
                chat_chunks(model, engine.tokenizer, results, texts, tools is not None, usage)
            )
        return chat_completion(
            model,
            engine.tokenizer,
            len(prompt_ids),
            results,
            texts,
            logprobs=body.logprobs,
            tools=tools is not None,
        )

    @router.post("/v1/completions", tags=["inference"])
    async def complete(claims: Caller, body: CompletionRequest):
        model, engine = await _engine_for(claims, body.model)
        if isinstance(body.prompt, str):
            prompt_ids = list(engine.tokenizer(body.prompt)["input_ids"])
        else:
            prompt_ids = list(body.prompt)
        if not prompt_ids:
            raise ModelProblem(400, "empty prompt")
        stop = stops(body.stop)
        results = await _sample(engine, prompt_ids, body, stop)
        texts = [_text(engine, r, stop) for r in results]
        if body.stream:
            usage = len(prompt_ids) if body.include_usage else None
            return event_stream(completion_chunks(model, engine.tokenizer, results, texts, usage))
        return text_completion(
            model,
            engine.tokenizer,
            len(prompt_ids),
            results,
            texts,
            logprobs=body.logprobs is not None,
        )

    return router


def body_budget(body) -> int | None:
    return body.token_budget if isinstance(body, ChatCompletionRequest) else body.max_tokens


def _text(engine, result: GenerationResult, stop: list[str]) -> str:
    return cut_at_stop(
        engine.tokenizer.decode(result.completion_ids, skip_special_tokens=True), stop
    )
