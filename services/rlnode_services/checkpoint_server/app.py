"""Wiring of the checkpoint-server: the subscriptions that build the index (`index.py`), the
read routes (`listings.py`), OpenAI-compatible inference on any checkpoint (`inference.py`),
and who may call them (`access.py`)."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlnode.bus import Bus
from rlnode.bus.signing import signing_for
from rlnode.messages import topics
from rlnode.service.app import create_service_app
from rlnode.service.auth import VaultTokenVerifier
from rlnode.service.db import create_tables, engine_for
from rlnode.service.db_outage import retry_on_outage, watch_database
from rlnode.service.http import Operator, install_error_handlers
from rlnode.service.openai_api import error_body
from rlnode_services.checkpoint_server.dashboard import dashboard_routes
from rlnode_services.checkpoint_server.events import event_routes
from rlnode_services.checkpoint_server.index import Indexer
from rlnode_services.checkpoint_server.inference import inference_routes
from rlnode_services.checkpoint_server.listings import listing_routes
from rlnode_services.checkpoint_server.models import Checkpoints, ModelCache, ModelProblem
from rlnode_services.checkpoint_server.org_events import OrgEventCopier
from rlnode_services.checkpoint_server.settings import SERVICE, CheckpointServerSettings
from rlnode_services.checkpoint_server.store import TABLES


def create_app(settings: CheckpointServerSettings) -> FastAPI:
    db = engine_for(SERVICE.name, settings.database, settings.node)
    create_tables(db, *TABLES)
    root = settings.node.checkpoint_dir
    indexer = Indexer(db, root)
    checkpoints = Checkpoints(db, root)
    cache = ModelCache(settings)
    bus = Bus(settings.kafka, service=SERVICE.name, **signing_for(settings))
    # Indexing is idempotent: what meets a database outage is indexed again once it is over.
    bus.subscribe(topics.JOB_EVENTS, retry_on_outage(indexer.on_event), group_id=settings.group_id)
    bus.subscribe(
        topics.WEIGHT_VERSIONS, retry_on_outage(indexer.on_weights), group_id=settings.group_id
    )
    # Apart from the index (a group of its own): a slow copy never holds back indexing.
    copier = OrgEventCopier(bus)
    bus.subscribe(topics.JOB_EVENTS, copier.on_event, group_id=settings.org_events_group_id)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await bus.start()
        yield
        await bus.stop()
        await cache.close()

    app = create_service_app(SERVICE, settings, lifespan=lifespan)
    app.state.failures.extend([bus.failures, cache.failures])
    app.state.verifier = VaultTokenVerifier(settings.vault_url)
    install_error_handlers(app)
    watch_database(app, db)

    @app.exception_handler(ModelProblem)
    async def _problem(_request: Request, exc: ModelProblem) -> JSONResponse:
        return JSONResponse(
            status_code=exc.status, content=error_body(exc.message, exc.kind, exc.status)
        )

    app.include_router(listing_routes(db, root, checkpoints))
    assert bus.verifier is not None
    app.include_router(event_routes(db, settings.kafka, bus.verifier))
    app.include_router(inference_routes(settings, checkpoints, cache))
    app.include_router(dashboard_routes(db, bus, settings.vault_url, settings.gateway_url))

    @app.get("/v1/checkpoint-server", tags=["ops"])
    async def status(_operator: Operator) -> dict[str, Any]:
        """The models loaded now (operators: they are every org's)."""
        return {
            "loaded": list(cache.engines),
            "bytes_used": cache.bytes_used,
            "cache_bytes": settings.cache_bytes,
            "loads": cache.loads,
        }

    return app
