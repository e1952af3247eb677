"""HTTP wiring of the rollout-generator: the per-rollout OpenAI-compatible endpoints the Task
Apps call, and the subscriptions: rollout work (shared by the generators' group), weight
versions and ended jobs (every generator reads all of both)."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rlnode.bus import Bus
from rlnode.bus.signing import signing_for
from rlnode.engine.base import EngineError
from rlnode.messages import topics
from rlnode.messages.tinker import SampleRequest, SampleResult
from rlnode.service.app import create_service_app
from rlnode.service.auth import AuthError, Scope, VaultTokenVerifier
from rlnode.service.http import Caller, Operator, install_error_handlers, json_response
from rlnode.service.openai_api import (
    BadChatRequest,
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunks,
    chat_completion,
    completion_chunks,
    error_body,
    event_stream,
    stops,
    text_completion,
    text_content,
)
from rlnode_services.rollout_generator.engines import EnginePool
from rlnode_services.rollout_generator.finished import FinishedJobs
from rlnode_services.rollout_generator.rollouts import (
    InferenceRefused,
    RenderedPrompts,
    RolloutRegistry,
    RolloutRunner,
)
from rlnode_services.rollout_generator.sampling import Samplers, SamplingRefused
from rlnode_services.rollout_generator.settings import SERVICE, GeneratorSettings
from rlnode_services.rollout_generator.weights import WeightSync
from rlnode_services.rollout_generator.work import WorkHandler


def _check_supported(n: int) -> None:
    if n != 1:
        raise InferenceRefused(
            400, "n must be 1 on rollout endpoints: each call is one recorded turn"
        )


def create_app(settings: GeneratorSettings) -> FastAPI:
    pool = EnginePool(settings)
    samplers = Samplers(settings, pool)
    registry = RolloutRegistry()
    bus = Bus(
        settings.kafka,
        service=f"{SERVICE.name}/{settings.generator_id}",
        **signing_for(settings),
    )
    weights = WeightSync(settings, pool, bus)
    runner = RolloutRunner(settings, pool, registry, weights)
    prompts = RenderedPrompts()
    # An ended job's engines are closed: each holds a model (and vLLM its KV cache), and a
    # generator that kept them ran out of memory after a few jobs (bench/methods.py).
    finished = FinishedJobs(bus, on_end=pool.release)
    work = WorkHandler(bus, runner.run, finished)
    work_subscription = bus.subscribe(
        topics.ROLLOUT_WORK,
        work.on_work,
        group_id=settings.work_group,
        concurrency=settings.concurrency,
        # A long rollout between two fetches must not cost the group membership.
        max_poll_interval_ms=int((settings.drain_timeout_s + 3600) * 1000),
        fetch_max_wait_ms=settings.kafka.rollout_fetch_max_wait_ms,
    )
    bus.subscribe(
        topics.WEIGHT_VERSIONS,
        weights.on_weight_version,
        group_id=None,
        fetch_max_wait_ms=settings.kafka.rollout_fetch_max_wait_ms,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await bus.start()
        yield
        # Rollouts in flight may finish (and publish) for drain_timeout_s; the rest stays
        # uncommitted for another generator.
        await bus.stop(settings.drain_timeout_s)
        await runner.aclose()
        await samplers.close()
        await pool.close()

    app = create_service_app(SERVICE, settings, lifespan=lifespan)
    app.state.failures.extend([bus.failures, pool.failures])
    app.state.health_checks["service_token"] = lambda: settings.service_token is not None
    app.state.verifier = VaultTokenVerifier(settings.vault_url)
    install_error_handlers(app)
    app.state.work = work_subscription
    app.state.registry = registry

    @app.exception_handler(InferenceRefused)
    async def _refused(_request: Request, exc: InferenceRefused) -> JSONResponse:
        return JSONResponse(
            status_code=exc.status,
            content=error_body(exc.message, code=exc.status),
        )

    @app.get("/v1/generator", tags=["ops"])
    async def status(_operator: Operator) -> dict[str, Any]:
        """What this generator holds (operators: it is every org's work)."""
        return {
            "generator": settings.generator_id,
            "rollouts_in_flight": len(registry),
            "trajectories_published": work.published,
            "work_skipped_for_ended_jobs": finished.skipped,
            "partitions": work_subscription.partitions,
            "jobs": {job: e.loaded_version for job, e in pool.jobs.items()},
        }

    @app.post("/v1/tinker/sample", tags=["inference"])
    async def tinker_sample(body: SampleRequest, claims: Caller) -> SampleResult:
        """Completions for a Tinker API sampling session (the tinker-api's service token)."""
        if not claims.node_wide_service or Scope.TINKER not in claims.scopes:
            raise AuthError(403, "this route is the tinker-api's: a service token with tinker")
        try:
            return await samplers.sample(body)
        except SamplingRefused as e:
            raise InferenceRefused(400, str(e)) from None
        except EngineError as e:
            raise InferenceRefused(503, f"the engine failed: {e}") from None

    @app.post("/rollouts/{rollout_id}/v1/chat/completions", tags=["inference"])
    async def chat_completions(rollout_id: str, body: ChatCompletionRequest) -> Response:
        """Sampling follows the job's config: temperature and top_p here are not honoured
        (the learner's importance ratio assumes the job's), and max_tokens can only lower it."""
        rollout = registry.get(rollout_id)
        _check_supported(body.n)
        try:
            tools = body.template_tools()
            messages = [text_content(m) for m in body.messages]
        except BadChatRequest as e:
            raise InferenceRefused(400, str(e)) from None
        prompt_ids = prompts.render(rollout.policy, messages, tools)
        turn, text = await rollout.complete(prompt_ids, body.token_budget, stops(body.stop))
        model = body.model or rollout.work.job_id
        if body.stream:  # agent frameworks that stream (verifiers 0.4 always does)
            usage = len(prompt_ids) if body.include_usage else None
            tokenizer, called = rollout.policy.tokenizer, tools is not None
            return event_stream(chat_chunks(model, tokenizer, [turn], [text], called, usage))
        return json_response(
            chat_completion(
                model,
                rollout.policy.tokenizer,
                len(prompt_ids),
                [turn],
                [text],
                tools=tools is not None,
            )
        )

    @app.post("/rollouts/{rollout_id}/v1/completions", tags=["inference"])
    async def completions(rollout_id: str, body: CompletionRequest) -> Response:
        rollout = registry.get(rollout_id)
        _check_supported(body.n)
        if isinstance(body.prompt, str):
            prompt_ids = list(rollout.policy.tokenizer(body.prompt)["input_ids"])
        else:
            prompt_ids = list(body.prompt)
        if not prompt_ids:
            raise InferenceRefused(400, "empty prompt")
        turn, text = await rollout.complete(prompt_ids, body.max_tokens, stops(body.stop))
        model = body.model or rollout.work.job_id
        if body.stream:
            usage = len(prompt_ids) if body.include_usage else None
            tokenizer = rollout.policy.tokenizer
            return event_stream(completion_chunks(model, tokenizer, [turn], [text], usage))
        return json_response(
            text_completion(model, rollout.policy.tokenizer, len(prompt_ids), [turn], [text])
        )

    return app
