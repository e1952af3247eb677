"""HTTP wiring of the checkpoint-server: the topic subscriptions that build the index, the
checkpoint and job listings (org-scoped), file downloads, and OpenAI-compatible inference on
any checkpoint (`model = "<job_id>@<step>"` or `"<job_id>@latest"`)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from sqlmodel import Session, col, select

from rlnode.bus import Bus
from rlnode.engine import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    cut_at_stop,
    render_chat,
)
from rlnode.engine.torch_engine import TorchEngine
from rlnode.messages import topics
from rlnode.service.app import create_service_app
from rlnode.service.auth import (
    AuthError,
    Scope,
    TokenClaims,
    TokenVerifier,
    VaultTokenVerifier,
    bearer_token,
)
from rlnode.service.db import create_tables, engine_for
from rlnode.service.http import install_error_handlers
from rlnode.service.openai_api import (
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
from rlnode_services.checkpoint_server.index import Indexer, local_path, metrics_path
from rlnode_services.checkpoint_server.models import Checkpoints, ModelCache, ModelProblem
from rlnode_services.checkpoint_server.settings import SERVICE, CheckpointServerSettings
from rlnode_services.checkpoint_server.store import TABLES, CheckpointRecord, JobSummary


def caller(request: Request, authorization: Annotated[str | None, Header()] = None) -> TokenClaims:
    claims = request.app.state.verifier.verify(bearer_token(authorization))
    if claims.org_id is None:
        raise AuthError(403, "use an org token: checkpoints belong to an org")
    return claims


Caller = Annotated[TokenClaims, Depends(caller)]


def _org(claims: TokenClaims) -> str:
    assert claims.org_id is not None  # `caller` admits org tokens only
    return claims.org_id


def _need(claims: TokenClaims, scope: Scope) -> None:
    TokenVerifier.authorize_claims(claims, scopes=[scope])


def create_app(settings: CheckpointServerSettings) -> FastAPI:
    db = engine_for(SERVICE.name, settings.database, settings.node)
    create_tables(db, *TABLES)
    root = settings.node.checkpoint_dir
    indexer = Indexer(db, root)
    checkpoints = Checkpoints(db, root)
    cache = ModelCache(settings)
    bus = Bus(settings.kafka, service=SERVICE.name)
    bus.subscribe(topics.JOB_EVENTS, indexer.on_event, group_id=settings.group_id)
    bus.subscribe(topics.WEIGHT_VERSIONS, indexer.on_weights, group_id=settings.group_id)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await bus.start()
        yield
        await bus.stop()
        await cache.close()

    app = create_service_app(SERVICE, settings, lifespan=lifespan)
    app.state.verifier = VaultTokenVerifier(settings.vault_url)
    install_error_handlers(app)

    @app.exception_handler(ModelProblem)
    async def _problem(_request: Request, exc: ModelProblem) -> JSONResponse:
        return JSONResponse(
            status_code=exc.status, content=error_body(exc.message, exc.kind, exc.status)
        )

    # -- listings ---------------------------------------------------------------------

    @app.get("/v1/checkpoints", tags=["checkpoints"])
    async def list_checkpoints(
        claims: Caller, job: Annotated[str | None, Query()] = None
    ) -> list[dict[str, Any]]:
        """Your org's checkpoints (of one job with ?job=), oldest first."""
        _need(claims, Scope.JOBS_READ)
        return [
            {
                "job_id": r.job_id,
                "step": r.step,
                "model": r.model,
                "uri": r.uri,
                "final": r.final,
                "on_disk": (p := local_path(r.uri, root)) is not None and p.exists(),
                "created_at": r.created_at.isoformat(),
            }
            for r in checkpoints.of_job(_org(claims), job)
        ]

    @app.get("/v1/checkpoints/{job_id}/{step}/files", tags=["checkpoints"])
    async def list_files(claims: Caller, job_id: str, step: str) -> list[dict[str, Any]]:
        _need(claims, Scope.JOBS_READ)
        _record, path = checkpoints.resolve(_org(claims), f"{job_id}@{step}")
        return [
            {"name": f.name, "size_bytes": f.stat().st_size}
            for f in sorted(path.iterdir())
            if f.is_file()
        ]

    @app.get("/v1/checkpoints/{job_id}/{step}/files/{name}", tags=["checkpoints"])
    async def download(claims: Caller, job_id: str, step: str, name: str) -> FileResponse:
        _need(claims, Scope.JOBS_READ)
        _record, path = checkpoints.resolve(_org(claims), f"{job_id}@{step}")
        files = {f.name: f for f in path.iterdir() if f.is_file()}  # never a path from the URL
        if name not in files:
            raise ModelProblem(
                404,
                f"checkpoint {job_id}@{step} has no file {name!r}; it has {', '.join(sorted(files))}",
                "not_found_error",
            )
        return FileResponse(files[name], filename=name)

    @app.get("/v1/models", tags=["inference"])
    async def models(claims: Caller) -> dict[str, Any]:
        """OpenAI's model list: every checkpoint, and `<job>@latest` per job."""
        _need(claims, Scope.INFERENCE)
        data, latest = [], {}
        for r in checkpoints.of_job(_org(claims), None):
            entry = {
                "id": r.model,
                "object": "model",
                "created": int(r.created_at.timestamp()),
                "owned_by": r.org_id,
            }
            data.append(entry)
            latest[r.job_id] = {**entry, "id": f"{r.job_id}@latest"}
        return {"object": "list", "data": data + list(latest.values())}

    @app.get("/v1/jobs", tags=["jobs"])
    async def jobs(claims: Caller) -> list[dict[str, Any]]:
        """Your org's jobs, newest first, as their events tell."""
        _need(claims, Scope.JOBS_READ)
        with Session(db) as s:
            rows = s.exec(
                select(JobSummary)
                .where(JobSummary.org_id == _org(claims))
                .order_by(col(JobSummary.created_at).desc())
            ).all()
        return [_summary(r) for r in rows]

    @app.get("/v1/jobs/{job_id}", tags=["jobs"])
    async def job(claims: Caller, job_id: str) -> dict[str, Any]:
        _need(claims, Scope.JOBS_READ)
        with Session(db) as s:
            row = s.get(JobSummary, job_id)
            ckpts = s.exec(select(CheckpointRecord).where(CheckpointRecord.job_id == job_id)).all()
        if row is None or row.org_id != _org(claims):
            raise ModelProblem(404, f"no job {job_id!r} in your org", "not_found_error")
        return {**_summary(row), "checkpoints": sorted(c.step for c in ckpts)}

    @app.get("/v1/jobs/{job_id}/metrics", tags=["jobs"])
    async def metrics(claims: Caller, job_id: str) -> FileResponse:
        """Every train.step of the job, one JSON object per line."""
        await job(claims, job_id)
        path = metrics_path(root, job_id)
        if not path.exists():
            raise ModelProblem(404, f"job {job_id!r} has no training steps yet", "not_found_error")
        return FileResponse(path, media_type="application/x-ndjson")

    # -- inference --------------------------------------------------------------------

    async def _engine_for(claims: TokenClaims, model: str | None) -> tuple[str, TorchEngine]:
        """The model name as asked (`<job>@latest` stays so) and its loaded engine."""
        _need(claims, Scope.INFERENCE)
        record, path = checkpoints.resolve(_org(claims), model)
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

    @app.post("/v1/chat/completions", tags=["inference"])
    async def chat(claims: Caller, body: ChatCompletionRequest):
        model, engine = await _engine_for(claims, body.model)
        try:
            prompt_ids = render_chat(engine.tokenizer, [text_content(m) for m in body.messages])
        except Exception as e:
            raise ModelProblem(
                400, f"cannot apply the chat template to these messages: {e}"
            ) from None
        stop = stops(body.stop)
        results = await _sample(engine, prompt_ids, body, stop)
        texts = [_text(engine, r, stop) for r in results]
        if body.stream:
            return event_stream(chat_chunks(model, engine.tokenizer, results, texts))
        return chat_completion(
            model, engine.tokenizer, len(prompt_ids), results, texts, logprobs=body.logprobs
        )

    @app.post("/v1/completions", tags=["inference"])
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
            return event_stream(completion_chunks(model, engine.tokenizer, results, texts))
        return text_completion(
            model,
            engine.tokenizer,
            len(prompt_ids),
            results,
            texts,
            logprobs=body.logprobs is not None,
        )

    @app.get("/v1/checkpoint-server", tags=["ops"])
    async def status() -> dict[str, Any]:
        return {
            "loaded": list(cache.engines),
            "bytes_used": cache.bytes_used,
            "cache_bytes": settings.cache_bytes,
            "loads": cache.loads,
        }

    return app


def body_budget(body) -> int | None:
    return body.token_budget if isinstance(body, ChatCompletionRequest) else body.max_tokens


def _summary(row: JobSummary) -> dict[str, Any]:
    return {
        "job_id": row.job_id,
        "status": row.status,
        "step": row.step,
        "total_steps": row.total_steps,
        "reward_mean": row.reward_mean,
        "loss": row.loss,
        "reason": row.reason,
        "created_at": row.created_at.isoformat(),
        "updated_at": row.updated_at.isoformat(),
    }


def _text(engine, result: GenerationResult, stop: list[str]) -> str:
    return cut_at_stop(
        engine.tokenizer.decode(result.completion_ids, skip_special_tokens=True), stop
    )
