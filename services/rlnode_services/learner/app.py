"""HTTP wiring of the learner: the job-request subscription, the job manager's lifecycle,
the Tinker API runs (tinker_runs.py), a read-only view of the jobs it owns, and the weight
versions it published (weights.py)."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from sqlmodel import Session, col, select

from rlnode.bus import Bus
from rlnode.bus.signing import signing_for
from rlnode.messages import topics
from rlnode.service.app import create_service_app
from rlnode.service.auth import Scope, TokenVerifier, VaultTokenVerifier, require_operator
from rlnode.service.db import engine_for
from rlnode.service.db_outage import retry_on_outage, watch_database
from rlnode.service.http import Caller, install_error_handlers
from rlnode_services.learner.intake import JobIntake
from rlnode_services.learner.jobs import JobManager
from rlnode_services.learner.settings import SERVICE, LearnerSettings
from rlnode_services.learner.store import JobRecord
from rlnode_services.learner.tinker_runs import TinkerRuns
from rlnode_services.learner.weights import weights_router


def create_app(settings: LearnerSettings) -> FastAPI:
    bus = Bus(settings.kafka, service=SERVICE.name, **signing_for(settings))
    engine = engine_for(SERVICE.name, settings.database, settings.node)
    verifier = VaultTokenVerifier(settings.vault_url)
    manager = JobManager(settings, bus, engine, JobIntake(settings, verifier, engine))
    tinker = TinkerRuns(settings, bus, manager.transport)
    # A request that meets a database outage is handled again once it is over (not lost).
    bus.subscribe(
        topics.JOB_REQUESTS, retry_on_outage(manager.on_request), group_id=settings.group_id
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await bus.start()
        await manager.start()
        await tinker.start()
        yield
        await tinker.stop()
        await manager.stop()
        await bus.stop()

    app = create_service_app(SERVICE, settings, lifespan=lifespan)
    app.state.failures.extend([bus.failures, manager.drivers.failures, tinker.drivers.failures])
    app.state.verifier = verifier
    install_error_handlers(app)
    watch_database(app, engine)
    app.state.health_checks["service_token"] = lambda: settings.service_token is not None
    app.include_router(weights_router(manager.published, settings.node.stores))

    @app.get("/v1/jobs", tags=["jobs"])
    async def jobs(claims: Caller) -> list[dict[str, Any]]:
        """The jobs this learner owns, newest first: the caller's org's (an org token with
        jobs:read), or every org's (an operator's token with node:ops)."""
        query = select(JobRecord).order_by(col(JobRecord.created_at).desc())
        if claims.org_id is None:
            require_operator(claims)
        else:
            TokenVerifier.authorize_claims(claims, scopes=[Scope.JOBS_READ])
            query = query.where(JobRecord.org_id == claims.org_id)
        with Session(engine) as s:
            records = s.exec(query).all()
        return [
            {
                "job_id": r.job_id,
                "org_id": r.org_id,
                "status": r.status,
                "step": r.step,
                "reason": r.reason,
            }
            for r in records
        ]

    return app
