"""HTTP wiring of the tinker-api: the routes the `tinker` SDK calls (/api/v1/...), each
behind an org's Tinker API key (`rlnode tinker key`: an org token with the `tinker` scope,
sent as `X-API-Key: tml-<token>`). Training calls go to the learner over the bus
(calls.py); what only needs remembering is answered from the database (store.py).

Every id a client names (session, model, checkpoint path, sampler) is looked up within its
key's org: another org's is not found (404), whether it exists or not."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

import orjson
from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, func, select

from rlnode.bus import Bus
from rlnode.bus.signing import signing_for
from rlnode.messages import topics, utc_now
from rlnode.messages.base import ID_PATTERN
from rlnode.messages.config import DEFAULT_LORA_TARGETS, LoraSpec
from rlnode.messages.tinker import (
    CloseRun,
    CreateRun,
    LoadWeights,
    OptimStep,
    SaveForSampler,
    SaveWeights,
)
from rlnode.service.app import create_service_app
from rlnode.service.auth import TINKER_KEY_PREFIX, AuthError, Scope, TokenClaims, VaultTokenVerifier
from rlnode.service.db import create_tables, engine_for, session_scope
from rlnode.service.http import install_error_handlers
from rlnode_services.tinker_api import wire
from rlnode_services.tinker_api.calls import Calls, internal_seq, tinker_path
from rlnode_services.tinker_api.futures import Futures
from rlnode_services.tinker_api.sampling import Sampling, sample_request
from rlnode_services.tinker_api.settings import SERVICE, TinkerApiSettings
from rlnode_services.tinker_api.store import (
    TABLES,
    TinkerCheckpoint,
    TinkerModel,
    TinkerSampler,
    TinkerSession,
)

API = "/api/v1"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class ApiError(Exception):
    """Answered as `{"detail": message}` with `status` (never an empty 400: the SDK takes
    an empty 400 for a broken connection)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


async def key_claims(
    request: Request, x_api_key: Annotated[str | None, Header()] = None
) -> TokenClaims:
    """The org behind a Tinker API key: `tml-` and an org token with the `tinker` scope."""
    if not x_api_key:
        raise AuthError(401, "no X-API-Key: send a Tinker API key (`rlnode tinker key`)")
    if not x_api_key.startswith(TINKER_KEY_PREFIX):
        raise AuthError(401, "a Tinker API key starts with tml- (`rlnode tinker key` makes one)")
    verifier = request.app.state.verifier
    if verifier.needs_refresh():
        await asyncio.to_thread(verifier.refresh)
    claims = verifier.verify(x_api_key.removeprefix(TINKER_KEY_PREFIX))
    if claims.kind != "org" or claims.org_id is None:
        raise AuthError(403, "a Tinker API key is an org's token (`rlnode tinker key`)")
    return VaultTokenVerifier.authorize_claims(claims, scopes=[Scope.TINKER])


Org = Annotated[TokenClaims, Depends(key_claims)]


def create_app(settings: TinkerApiSettings) -> FastAPI:
    bus = Bus(settings.kafka, service=SERVICE.name, **signing_for(settings))
    engine = engine_for(SERVICE.name, settings.database, settings.node)
    create_tables(engine, *TABLES)
    verifier = VaultTokenVerifier(settings.vault_url)
    futures = Futures(settings.result_ttl_s)
    calls = Calls(bus, engine, futures)
    sampling = Sampling(settings, futures)
    bus.subscribe(topics.TINKER_RESULTS, calls.on_result, group_id=None, from_beginning=False)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await bus.start()
        yield
        await sampling.close()
        await bus.stop()

    app = create_service_app(SERVICE, settings, lifespan=lifespan)
    app.state.failures.append(bus.failures)
    app.state.verifier = verifier
    app.state.health_info["pending_futures"] = futures.pending
    install_error_handlers(app)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse({"detail": e.message}, status_code=e.status)

    # -- lookups, always within the caller's org --------------------------------------------

    def session_of(org: TokenClaims, session_id: str) -> TinkerSession:
        with Session(engine) as s:
            found = s.get(TinkerSession, session_id)
        if found is None or found.org_id != org.org_id:
            raise ApiError(404, f"no session {session_id!r}")
        return found

    def model_of(org: TokenClaims, model_id: str) -> TinkerModel:
        with Session(engine) as s:
            found = s.get(TinkerModel, model_id)
        if found is None or found.org_id != org.org_id:
            raise ApiError(404, f"no training run {model_id!r}")
        return found

    def checkpoint_of(org: TokenClaims, path: str) -> TinkerCheckpoint:
        with Session(engine) as s:
            found = s.get(TinkerCheckpoint, path)
        if found is None or found.org_id != org.org_id:
            raise ApiError(404, f"no checkpoint {path!r}")
        return found

    def newest(table: Any, org: TokenClaims, limit: int, offset: int) -> tuple[list[Any], int]:
        """A page of the org's rows of `table`, newest first, and how many it has in all."""
        where = table.org_id == org.org_id
        with Session(engine) as s:
            total = s.exec(select(func.count()).select_from(table).where(where)).one()
            rows = s.exec(
                select(table)
                .where(where)
                .order_by(col(table.created_at).desc())
                .offset(offset)
                .limit(limit)
            ).all()
        return list(rows), total

    def source_of(base_model: str) -> str:
        return settings.base_models.get(base_model, base_model)

    def touch(model: TinkerModel) -> None:
        with session_scope(engine) as s:
            model.last_request = utc_now()
            s.merge(model)

    def future(request_id: str, model_id: str | None = None) -> dict[str, Any]:
        return {"request_id": request_id, **({"model_id": model_id} if model_id else {})}

    def seq_of(body: dict[str, Any]) -> int:
        """A JSON call's place in its model's order (the SDK's seq_id, numbered as here)."""
        return internal_seq(int(body.get("seq_id") or 0))

    @asynccontextmanager
    async def keeping_place(model: TinkerModel, seq: int):
        """A call refused in here still takes its place in the model's order (calls.skip):
        the client numbered it, and its later calls must not wait for it."""
        try:
            yield
        except ApiError:
            await calls.skip(model.model_id, seq)
            raise

    # -- the client's own settings -------------------------------------------------------------

    @app.post(API + "/client/config", tags=["tinker"])
    async def client_config(_org: Org) -> dict[str, Any]:
        # The plain httpx transport: the SDK's other one is not needed on a node.
        return {"use_pyqwest_transport": False, "pjwt_auth_enabled": False}

    @app.post(API + "/client/dynamic_config", tags=["tinker"])
    async def dynamic_config(_org: Org) -> dict[str, Any]:
        return {}

    @app.get(API + "/healthz", tags=["tinker"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post(API + "/telemetry", tags=["tinker"])
    async def telemetry(_org: Org) -> dict[str, str]:
        return {"status": "accepted"}  # the SDK's usage events: not kept

    @app.get(API + "/get_server_capabilities", tags=["tinker"])
    async def capabilities(_org: Org) -> dict[str, Any]:
        return {
            "supported_models": [
                {"model_name": name, "trainable": True, "sampleable": True}
                for name in settings.base_models
            ]
        }

    # -- sessions ------------------------------------------------------------------------------

    @app.post(API + "/create_session", tags=["tinker"])
    async def create_session(org: Org, body: dict[str, Any]) -> dict[str, Any]:
        session_id = str(uuid.uuid4())
        assert org.org_id is not None
        with session_scope(engine) as s:
            s.add(
                TinkerSession(
                    session_id=session_id,
                    org_id=org.org_id,
                    user_metadata=json.dumps(body.get("user_metadata") or {}),
                )
            )
        return {"session_id": session_id, "type": "create_session"}

    @app.post(API + "/session_heartbeat", tags=["tinker"])
    async def heartbeat(org: Org, body: dict[str, Any]) -> dict[str, Any]:
        session = session_of(org, str(body.get("session_id")))
        with session_scope(engine) as s:
            session.last_seen = utc_now()
            s.merge(session)
        return {"type": "session_heartbeat"}

    @app.post(API + "/sessions/{session_id}/finish", tags=["tinker"])
    async def finish(org: Org, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        session = session_of(org, session_id)
        reason = (body.get("reason") or {}).get("type", "success")
        with session_scope(engine) as s:
            session.finished = str(reason)[:32]
            s.merge(session)
            models = s.exec(select(TinkerModel).where(TinkerModel.session_id == session_id)).all()
        for model in models:  # free the learner's trainers; checkpoints stay
            with Session(engine) as s:
                current = s.get(TinkerModel, model.model_id)
            assert current is not None
            await calls.submit(current, current.next_seq, CloseRun(), "close")
        return {}

    @app.get(API + "/sessions/{session_id}", tags=["tinker"])
    async def get_session(org: Org, session_id: str) -> dict[str, Any]:
        session = session_of(org, session_id)
        with Session(engine) as s:
            models = s.exec(select(TinkerModel).where(TinkerModel.session_id == session_id)).all()
            samplers = s.exec(
                select(TinkerSampler).where(TinkerSampler.session_id == session_id)
            ).all()
        return {
            "training_run_ids": [m.model_id for m in models],
            "sampler_ids": [x.sampler_id for x in samplers],
            "user_metadata": json.loads(session.user_metadata) or None,
        }

    @app.get(API + "/sessions", tags=["tinker"])
    async def list_sessions(org: Org, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        rows, _total = newest(TinkerSession, org, limit, offset)
        return {"sessions": [r.session_id for r in rows]}

    # -- training runs ---------------------------------------------------------------------------

    @app.post(API + "/create_model", tags=["tinker"])
    async def create_model(org: Org, body: dict[str, Any]) -> dict[str, Any]:
        session = session_of(org, str(body.get("session_id")))
        model = _new_model(org, session, body, source_of)
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise ApiError(400, f"optimizer {optimizer!r} is not supported here: use adamw")
        if (first := calls.resent(model.model_id, 0, "create_model")) is not None:
            return future(first, model.model_id)  # sent again: its first answer
        with session_scope(engine) as s:
            if s.get(TinkerModel, model.model_id) is not None:
                raise ApiError(409, f"model {model.model_id} exists already")
            s.add(model)
        create = CreateRun(
            base_model=model.source, lora=_lora_of(body.get("lora_config")), seed=_seed(body)
        )
        request_id = await calls.start_run(model, create, None, "create_model")
        return future(request_id, model.model_id)

    @app.post(API + "/get_info", tags=["tinker"])
    async def get_info(org: Org, body: dict[str, Any]) -> dict[str, Any]:
        model = model_of(org, str(body.get("model_id")))
        return {
            "type": "get_info",
            "model_id": model.model_id,
            "model_data": {
                "model_name": model.base_model,
                # The tokenizer the learner loads: the client reads it locally.
                "tokenizer_id": model.source,
            },
            "is_lora": model.lora_rank is not None,
            "lora_rank": model.lora_rank,
            "model_name": model.base_model,
        }

    @app.post(API + "/forward_backward", tags=["tinker"])
    async def forward_backward(
        org: Org,
        request: Request,
        content_encoding: Annotated[str | None, Header()] = None,
    ) -> dict[str, Any]:
        body = await request.body()
        if len(body) > settings.max_body_bytes:
            raise ApiError(
                413,
                f"the request holds {len(body)} bytes, over this node's "
                f"{settings.max_body_bytes} (TINKER_API_MAX_BODY_BYTES): send fewer datums",
            )
        try:
            model_id, seq, op = wire.parse_forward_backward(body, content_encoding)
        except wire.WireError as e:
            placed = wire.forward_backward_place(body, content_encoding)
            if placed is not None:  # a request whose datums are refused keeps its place
                async with keeping_place(model_of(org, placed[0]), internal_seq(placed[1])):
                    raise ApiError(400, str(e)) from None
            raise ApiError(400, str(e)) from None
        model = model_of(org, model_id)
        touch(model)
        request_id = await calls.submit(model, internal_seq(seq), op, "forward_backward")
        return future(request_id, model.model_id)

    @app.post(API + "/optim_step", tags=["tinker"])
    async def optim_step(
        org: Org,
        body: dict[str, Any],
    ) -> dict[str, Any]:
        model = model_of(org, str(body.get("model_id")))
        seq = seq_of(body)
        if (first := calls.resent(model.model_id, seq, "optim_step")) is not None:
            return future(first, model.model_id)  # sent again: its first answer
        async with keeping_place(model, seq):
            if body.get("adam_params") is None:
                raise ApiError(400, "optim_step needs adam_params: this node's optimizer is AdamW")
            try:
                op = OptimStep.model_validate(body["adam_params"])
            except ValueError as e:
                raise ApiError(400, f"adam_params: {e}") from None
        request_id = await calls.submit(model, seq, op, "optim_step")
        return future(request_id, model.model_id)

    @app.post(API + "/save_weights", tags=["tinker"])
    async def save_weights(
        org: Org,
        body: dict[str, Any],
    ) -> dict[str, Any]:
        model = model_of(org, str(body.get("model_id")))
        seq = seq_of(body)
        if (first := calls.resent(model.model_id, seq, "save_weights")) is not None:
            return future(first, model.model_id)  # sent again: its first answer
        async with keeping_place(model, seq):
            name = _checkpoint_name(body.get("path"))
            path = tinker_path(model.model_id, "training", name)
            if not body.get("overwrite") and _exists(engine, path):
                raise ApiError(
                    409, f"checkpoint {name!r} of {model.model_id} exists; pass overwrite"
                )
        request_id = await calls.submit(
            model,
            seq,
            SaveWeights(name=name),
            "save_weights",
            name=name,
            user_metadata=body.get("user_metadata"),
        )
        return future(request_id, model.model_id)

    @app.post(API + "/save_weights_for_sampler", tags=["tinker"])
    async def save_for_sampler(
        org: Org,
        body: dict[str, Any],
    ) -> dict[str, Any]:
        model = model_of(org, str(body.get("model_id")))
        seq = seq_of(body)
        if (first := calls.resent(model.model_id, seq, "save_weights_for_sampler")) is not None:
            return future(first, model.model_id)  # sent again: its first answer
        async with keeping_place(model, seq):
            name = _checkpoint_name(body["path"]) if body.get("path") else None
            context: dict[str, Any] = {"name": name, "user_metadata": body.get("user_metadata")}
            if name is None:
                if body.get("sampling_session_seq_id") is None:
                    raise ApiError(400, "name the weights (path) or give sampling_session_seq_id")
                context["sampling_session_seq_id"] = int(body["sampling_session_seq_id"])
        request_id = await calls.submit(
            model,
            seq,
            SaveForSampler(name=name),
            "save_weights_for_sampler",
            **context,
        )
        return future(request_id, model.model_id)

    @app.post(API + "/load_weights", tags=["tinker"])
    async def load_weights(
        org: Org,
        body: dict[str, Any],
    ) -> dict[str, Any]:
        path = str(body.get("path") or "")

        def checkpoint_to_load() -> tuple[TinkerModel, LoadWeights]:
            checkpoint = checkpoint_of(org, path)
            if checkpoint.kind != "training":
                raise ApiError(
                    400, f"{path} holds sampler weights; load_weights takes weights/ paths"
                )
            source = model_of(org, checkpoint.model_id)
            load = LoadWeights(
                source_run=source.job_id,
                name=checkpoint.name,
                with_optimizer=bool(body.get("optimizer")),
            )
            return source, load

        if body.get("model_id"):  # into an existing run (TrainingClient.load_state)
            model = model_of(org, str(body["model_id"]))
            seq = seq_of(body)
            if (first := calls.resent(model.model_id, seq, "load_weights")) is not None:
                return future(first, model.model_id)  # sent again: its first answer
            async with keeping_place(model, seq):
                source, load = checkpoint_to_load()
                if (model.source, model.lora_config) != (source.source, source.lora_config):
                    raise ApiError(
                        400,
                        f"{path} is of a run of {source.base_model} (LoRA rank "
                        f"{source.lora_rank}); {model.model_id} trains {model.base_model} (LoRA "
                        f"rank {model.lora_rank}): load it into a new training client "
                        "(create_training_client_from_state)",
                    )
            request_id = await calls.submit(
                model,
                seq,
                load,
                "load_weights",
                path=path,
            )
            return future(request_id, model.model_id)
        # A new run from the checkpoint (create_training_client_from_state*).
        source, load = checkpoint_to_load()
        session = session_of(org, str(body.get("session_id")))
        lora_config = json.loads(source.lora_config) if source.lora_config else None
        spec = {
            "model_seq_id": body.get("model_seq_id"),
            "base_model": source.base_model,
            "lora_config": lora_config,
            "user_metadata": body.get("user_metadata"),
        }
        model = _new_model(org, session, spec, source_of)
        if (first := calls.resent(model.model_id, 0, "load_weights")) is not None:
            return future(first, model.model_id)  # sent again: its first answer
        with session_scope(engine) as s:
            if s.get(TinkerModel, model.model_id) is not None:
                raise ApiError(409, f"model {model.model_id} exists already")
            s.add(model)
        create = CreateRun(base_model=model.source, lora=_lora_of(lora_config))
        request_id = await calls.start_run(model, create, load, "load_weights", path=path)
        return future(request_id, model.model_id)

    @app.post(API + "/weights_info", tags=["tinker"])
    async def weights_info(org: Org, body: dict[str, Any]) -> dict[str, Any]:
        checkpoint = checkpoint_of(org, str(body.get("tinker_path")))
        model = model_of(org, checkpoint.model_id)
        lora = json.loads(model.lora_config) if model.lora_config else {}
        return {
            "base_model": model.base_model,
            "is_lora": model.lora_rank is not None,
            "lora_rank": model.lora_rank,
            **{k: lora.get(k, True) for k in ("train_unembed", "train_mlp", "train_attn") if lora},
        }

    # -- sampling sessions ---------------------------------------------------------------------

    def sampler_of(org: TokenClaims, sampler_id: str) -> TinkerSampler:
        with Session(engine) as s:
            found = s.get(TinkerSampler, sampler_id)
        if found is None or found.org_id != org.org_id:
            raise ApiError(404, f"no sampling session {sampler_id!r}")
        return found

    @app.post(API + "/create_sampling_session", tags=["tinker"])
    async def create_sampling_session(org: Org, body: dict[str, Any]) -> dict[str, Any]:
        session = session_of(org, str(body.get("session_id")))
        sampler_id = f"{session.session_id}:sample:{int(body.get('sampling_session_seq_id') or 0)}"
        assert org.org_id is not None
        sampler = TinkerSampler(
            sampler_id=sampler_id,
            org_id=org.org_id,
            session_id=session.session_id,
            base_model="",
            source="",
        )
        if body.get("model_path"):
            path = str(body["model_path"])
            checkpoint = checkpoint_of(org, path)
            if checkpoint.kind != "sampler":
                raise ApiError(
                    400,
                    f"{path} is a training checkpoint: sample from sampler_weights/ paths "
                    "(save_weights_for_sampler)",
                )
            model = model_of(org, checkpoint.model_id)
            sampler.base_model, sampler.source = model.base_model, model.source
            sampler.model_path, sampler.job_id = path, model.job_id
            sampler.weight_version, sampler.uri = checkpoint.weight_version, checkpoint.uri
        elif body.get("base_model"):
            name = str(body["base_model"])
            # Only the node's own base models: a path of the client's choosing could name
            # files that are not theirs (another org's checkpoints).
            if name not in settings.base_models and name not in settings.base_models.values():
                served = ", ".join(settings.base_models) or "none (TINKER_API_BASE_MODELS)"
                raise ApiError(
                    400, f"base model {name!r} is not served here; this node's: {served}"
                )
            sampler.base_model, sampler.source = name, source_of(name)
        else:
            raise ApiError(400, "name what to sample: base_model or model_path")
        with session_scope(engine) as s:
            s.merge(sampler)
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    @app.get(API + "/samplers/{sampler_id}", tags=["tinker"])
    async def get_sampler(org: Org, sampler_id: str) -> dict[str, Any]:
        sampler = sampler_of(org, sampler_id)
        return {
            "sampler_id": sampler.sampler_id,
            "base_model": sampler.base_model,
            "model_path": sampler.model_path,
        }

    @app.post(API + "/asample", tags=["tinker"])
    async def asample(org: Org, body: dict[str, Any]) -> dict[str, Any]:
        if not body.get("sampling_session_id"):
            raise ApiError(400, "asample needs a sampling_session_id (create_sampling_session)")
        sampler = sampler_of(org, str(body["sampling_session_id"]))
        adapter = None
        if sampler.job_id is not None:
            with Session(engine) as s:
                run = s.exec(
                    select(TinkerModel).where(TinkerModel.job_id == sampler.job_id)
                ).first()
            if run is not None and run.lora_config:
                adapter = _lora_of(json.loads(run.lora_config))
        assert org.org_id is not None
        try:
            request = sample_request(
                body,
                org_id=org.org_id,
                base_source=sampler.source,
                job_id=sampler.job_id,
                weight_version=sampler.weight_version,
                weights_uri=sampler.uri,
                adapter=adapter,
            )
        except wire.WireError as e:
            raise ApiError(400, str(e)) from None
        request_id, _future = futures.open(org.org_id, "sample")
        last_n = body.get("prompt_logprobs_last_n")
        sampling.start(request_id, request, int(last_n) if last_n is not None else None)
        return {
            "request_id": request_id,
            "sample_sequence_ids": [f"{request_id}:{i}" for i in range(request.num_samples)],
        }

    # -- futures -------------------------------------------------------------------------------

    @app.post(API + "/retrieve_future", tags=["tinker"])
    async def retrieve_future(org: Org, body: dict[str, Any]) -> Response:
        request_id = str(body.get("request_id"))
        pending = futures.get(request_id)
        if pending is None or pending.org_id != org.org_id:
            raise ApiError(
                404, f"no request {request_id!r} (answers are kept {settings.result_ttl_s:g} s)"
            )
        answer = await futures.wait(pending, settings.long_poll_s)
        if answer is None:
            return Response(
                orjson.dumps(
                    {"type": "try_again", "request_id": request_id, "queue_state": "active"}
                ),
                media_type="application/json",
            )
        return Response(answer.body, media_type=answer.media_type)

    # -- training runs and checkpoints (RestClient) -------------------------------------------

    def checkpoint_json(c: TinkerCheckpoint) -> dict[str, Any]:
        segment = "weights" if c.kind == "training" else "sampler_weights"
        return {
            "checkpoint_id": f"{segment}/{c.name}",
            "checkpoint_type": c.kind,
            "time": c.created_at.isoformat(),
            "tinker_path": c.tinker_path,
            "size_bytes": c.size_bytes,
            "public": False,
            "user_metadata": json.loads(c.user_metadata) if c.user_metadata else None,
        }

    def run_json(m: TinkerModel) -> dict[str, Any]:
        with Session(engine) as s:
            checkpoints = s.exec(
                select(TinkerCheckpoint)
                .where(TinkerCheckpoint.model_id == m.model_id)
                .order_by(col(TinkerCheckpoint.created_at).desc())
            ).all()
        last = {
            kind: next((c for c in checkpoints if c.kind == kind), None)
            for kind in ("training", "sampler")
        }
        metadata = json.loads(m.user_metadata) or None
        return {
            "training_run_id": m.model_id,
            "base_model": m.base_model,
            "model_owner": m.org_id,
            "is_lora": m.lora_rank is not None,
            "lora_rank": m.lora_rank,
            "last_request_time": m.last_request.isoformat(),
            "last_checkpoint": checkpoint_json(last["training"]) if last["training"] else None,
            "last_sampler_checkpoint": checkpoint_json(last["sampler"])
            if last["sampler"]
            else None,
            "user_metadata": {k: str(v) for k, v in metadata.items()} if metadata else None,
        }

    @app.get(API + "/training_runs", tags=["tinker"])
    async def training_runs(org: Org, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        rows, total = newest(TinkerModel, org, limit, offset)
        return {
            "training_runs": [run_json(m) for m in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total},
        }

    @app.get(API + "/training_runs/{model_id}", tags=["tinker"])
    async def training_run(org: Org, model_id: str) -> dict[str, Any]:
        return run_json(model_of(org, model_id))

    @app.get(API + "/training_runs/{model_id}/checkpoints", tags=["tinker"])
    async def run_checkpoints(org: Org, model_id: str) -> dict[str, Any]:
        model = model_of(org, model_id)
        with Session(engine) as s:
            rows = s.exec(
                select(TinkerCheckpoint)
                .where(TinkerCheckpoint.model_id == model.model_id)
                .order_by(col(TinkerCheckpoint.created_at))
            ).all()
        return {"checkpoints": [checkpoint_json(c) for c in rows]}

    @app.get(API + "/checkpoints", tags=["tinker"])
    async def all_checkpoints(org: Org, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        rows, total = newest(TinkerCheckpoint, org, limit, offset)
        return {
            "checkpoints": [checkpoint_json(c) for c in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total},
        }

    @app.delete(API + "/training_runs/{model_id}/checkpoints/{segment}/{name}", tags=["tinker"])
    async def delete_checkpoint(org: Org, model_id: str, segment: str, name: str) -> Response:
        kind = {"weights": "training", "sampler_weights": "sampler"}.get(segment)
        if kind is None:
            raise ApiError(404, f"no checkpoint {segment}/{name} of {model_id}")
        checkpoint = checkpoint_of(org, tinker_path(model_id, kind, name))
        with session_scope(engine) as s:
            stored = s.get(TinkerCheckpoint, checkpoint.tinker_path)
            if stored is not None:
                s.delete(stored)
        # The files stay with the run's other checkpoints: the node's retention removes
        # them with the run (a deleted path is no longer loadable through the API).
        return Response(status_code=204)

    return app


# -- translations of the client's fields -------------------------------------------------------


def _new_model(
    org: TokenClaims,
    session: TinkerSession,
    body: dict[str, Any],
    source_of: Callable[[str], str],
) -> TinkerModel:
    if body.get("model_seq_id") is None:
        raise ApiError(400, "model_seq_id is missing")
    base_model = str(body.get("base_model") or "")
    if not base_model:
        raise ApiError(400, "base_model is missing: name the model to train")
    n = int(body["model_seq_id"])
    lora = body.get("lora_config")
    assert org.org_id is not None
    return TinkerModel(
        model_id=f"{session.session_id}:train:{n}",
        org_id=org.org_id,
        session_id=session.session_id,
        job_id=f"tinker-{session.session_id}-{n}",
        base_model=base_model,
        source=source_of(base_model),
        lora_rank=int(lora["rank"]) if lora else None,
        lora_config=json.dumps(lora) if lora else None,
        user_metadata=json.dumps(body.get("user_metadata") or {}),
    )


def _lora_of(config: dict[str, Any] | None) -> LoraSpec | None:
    """Tinker's LoraConfig (rank; attention and MLP adapters) as rlnode's. `train_unembed`
    is not applied: the output layer stays frozen (an adapter on a tied output layer cannot
    be merged into the engines' weights without changing the embedding; docs/decisions.md)."""
    if config is None:
        return None
    targets = [
        *(ATTENTION if config.get("train_attn", True) else ()),
        *(MLP if config.get("train_mlp", True) else ()),
    ]
    if not targets:
        raise ApiError(400, "lora_config trains nothing: set train_attn or train_mlp")
    return LoraSpec(
        rank=int(config["rank"]),
        alpha=32,
        target_modules=[t for t in DEFAULT_LORA_TARGETS if t in targets],
    )


def _seed(body: dict[str, Any]) -> int:
    lora = body.get("lora_config") or {}
    return int(lora.get("seed") or 0)


def _checkpoint_name(path: Any) -> str:
    name = str(path) if path else f"ckpt-{uuid.uuid4().hex[:12]}"
    if not re.match(ID_PATTERN, name):
        raise ApiError(
            400, f"checkpoint name {name!r}: use letters, digits, '.', '_' and '-' (128 at most)"
        )
    return name


def _exists(engine: Engine, path: str) -> bool:
    with Session(engine) as s:
        return s.get(TinkerCheckpoint, path) is not None
