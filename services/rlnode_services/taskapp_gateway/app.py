"""HTTP wiring of the taskapp-gateway: routes, who may call them, and error mapping."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from rlnode.service.app import create_service_app
from rlnode.service.auth import (
    AuthError,
    Scope,
    TokenClaims,
    TokenVerifier,
    VaultTokenVerifier,
)
from rlnode.service.db import engine_for
from rlnode.service.db_outage import watch_database
from rlnode.service.http import BodySizeLimit, Caller, install_error_handlers
from rlnode_services.taskapp_gateway.gateway import Gateway, GatewayError
from rlnode_services.taskapp_gateway.keys import KeyProvider
from rlnode_services.taskapp_gateway.schemas import (
    ErrorOut,
    ManagedStatus,
    RegisterTaskApp,
    RolloutOutcome,
    RolloutOutcomes,
    RunRollout,
    RunRollouts,
    TaskAppOut,
    VerifyReport,
)
from rlnode_services.taskapp_gateway.settings import SERVICE, GatewaySettings
from rlnode_services.taskapp_gateway.store import TaskAppRecord

MAX_BODY_BYTES = 1024 * 1024
ERRORS = {
    401: {"model": ErrorOut, "description": "No valid token."},
    403: {"model": ErrorOut, "description": "The token may not do this (scope or org)."},
    404: {"model": ErrorOut, "description": "No such Task App in this org."},
}


def create_app(settings: GatewaySettings) -> FastAPI:
    keys = KeyProvider(
        settings.vault_url,
        settings.service_token.get_secret_value() if settings.service_token else None,
        settings.key_cache_s,
    )
    gateway = Gateway(
        engine_for(SERVICE.name, settings.database, settings.node),
        settings,
        keys,
        settings.node.data_dir / "taskapps",
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await gateway.start()
        yield
        await gateway.aclose()  # stops every managed Task App

    app = create_service_app(SERVICE, settings, lifespan=lifespan, responses=ERRORS)
    app.state.verifier = VaultTokenVerifier(settings.vault_url)
    app.state.gateway = gateway
    app.state.failures.append(gateway.failures)
    app.state.health_checks["service_token"] = lambda: keys.configured
    # A gateway whose managed Task Apps cannot be isolated is degraded, and says why.
    app.state.health_checks["taskapp_network"] = lambda: gateway.network.unavailable is None
    app.state.health_info["taskapp_network"] = gateway.network.describe
    install_error_handlers(app)
    watch_database(app, gateway.engine)
    app.add_middleware(BodySizeLimit, max_bytes=MAX_BODY_BYTES)

    @app.exception_handler(GatewayError)
    async def _gateway_error(_request: Request, exc: GatewayError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content={"detail": exc.message})

    def out(record: TaskAppRecord) -> TaskAppOut:
        managed = gateway.managed_status(record)
        return TaskAppOut(
            org_id=record.org_id,
            name=record.name,
            kind=record.kind,
            url=record.url
            if record.kind == "external"
            else (managed.url if managed and managed.status.port else None),
            command=json.loads(record.command) if record.command else None,
            secret=record.secret,
            created_at=record.created_at,
            managed=ManagedStatus(**vars(managed.status)) if managed else None,
        )

    @app.post(
        "/v1/orgs/{org_id}/taskapps", status_code=201, response_model=TaskAppOut, tags=["taskapps"]
    )
    async def register(org_id: str, body: RegisterTaskApp, who: Caller) -> TaskAppOut:
        """Register an external Task App (url) or a managed one (command; started now)."""
        who_may(who, org_id, Scope.TASKAPPS_WRITE)
        return out(await gateway.register(org_id, body))

    @app.get("/v1/orgs/{org_id}/taskapps", response_model=list[TaskAppOut], tags=["taskapps"])
    async def list_taskapps(org_id: str, who: Caller) -> list[TaskAppOut]:
        who_may(who, org_id, Scope.TASKAPPS_READ)
        return [out(r) for r in gateway.list(org_id)]

    @app.get("/v1/orgs/{org_id}/taskapps/{name}", response_model=TaskAppOut, tags=["taskapps"])
    async def get_taskapp(org_id: str, name: str, who: Caller) -> TaskAppOut:
        who_may(who, org_id, Scope.TASKAPPS_READ)
        return out(gateway.get(org_id, name))

    @app.delete("/v1/orgs/{org_id}/taskapps/{name}", status_code=204, tags=["taskapps"])
    async def unregister(org_id: str, name: str, who: Caller) -> Response:
        """Remove it; a managed Task App is stopped."""
        who_may(who, org_id, Scope.TASKAPPS_WRITE)
        await gateway.unregister(org_id, name)
        return Response(status_code=204)

    @app.post(
        "/v1/orgs/{org_id}/taskapps/{name}/verify", response_model=VerifyReport, tags=["taskapps"]
    )
    async def verify(org_id: str, name: str, who: Caller) -> VerifyReport:
        """Check it as a job would: healthy, accepts the org's key, refuses a wrong one."""
        who_may(who, org_id, Scope.TASKAPPS_READ)
        return await gateway.verify(org_id, name)

    @app.get(
        "/v1/orgs/{org_id}/taskapps/{name}/logs",
        response_class=PlainTextResponse,
        tags=["taskapps"],
    )
    async def logs(
        org_id: str,
        name: str,
        who: Caller,
        max_bytes: Annotated[int, Query(ge=1, le=1_000_000)] = 20_000,
    ) -> str:
        """The managed Task App's captured output (the key is blanked out)."""
        who_may(who, org_id, Scope.TASKAPPS_READ)
        record = gateway.get(org_id, name)
        managed = gateway.managed_status(record)
        if record.kind == "managed" and managed is None:
            gateway.check_runs_managed(name)
        if managed is None:
            raise GatewayError(f"{name!r} is external: its logs are wherever it runs", 404)
        return managed.log_tail(max_bytes)

    @app.post("/v1/rollouts", response_model=RolloutOutcome, tags=["rollouts"])
    async def rollout(body: RunRollout, who: Caller) -> Response:
        """For services: run one rollout on the org's Task App with the org's key."""
        who_may(who, body.org_id, Scope.ROLLOUTS_RUN)
        if who.kind != "service":
            raise AuthError(403, "only service tokens with rollouts:run may run rollouts")
        outcome = await gateway.rollout(
            body.org_id, body.task_app, body.request, body.job_id, body.timeout_s
        )
        # Built and checked by the gateway: encoded once, not validated again on the way out.
        return Response(outcome.model_dump_json(), media_type="application/json")

    @app.post("/v1/rollout-groups", response_model=RolloutOutcomes, tags=["rollouts"])
    async def rollout_group(body: RunRollouts, who: Caller) -> Response:
        """For services: run several rollouts of one job at once (a group's samples), each
        failing alone; answered together, in order. One call for the lot is most of what a
        rollout costs the gateway when the Task App answers quickly (#18)."""
        who_may(who, body.org_id, Scope.ROLLOUTS_RUN)
        if who.kind != "service":
            raise AuthError(403, "only service tokens with rollouts:run may run rollouts")
        outcomes = await gateway.rollouts(
            body.org_id,
            body.task_app,
            body.requests,
            body.job_id,
            body.timeout_s,
            body.with_response,
        )
        return Response(
            RolloutOutcomes(outcomes=list(outcomes)).model_dump_json(),
            media_type="application/json",
        )

    return app


def who_may(who: TokenClaims, org_id: str, scope: str) -> None:
    TokenVerifier.authorize_claims(who, scopes=[scope], org_id=org_id)
