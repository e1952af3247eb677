"""The dashboard's routes: starting and cancelling jobs over HTTP (a browser cannot reach
Kafka), a job's rollout samples, the node's state, and the page itself (static files under
dashboard/, the chart library `make setup` puts in dashboard/vendor/). Every route is the
caller's org's only, checked like the SDK's routes; the page keeps the org token in the
browser's session storage and sends it as a bearer header, never in a URL."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, RedirectResponse
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from rlnode.bus import Bus
from rlnode.messages import ENDED_STATUSES, JobRequest
from rlnode.messages.codec import describe_validation_error
from rlnode.messages.jobs import JobAction
from rlnode.node.health import services_health
from rlnode.node.local import state_path
from rlnode.sdk.gateway import GatewayClient
from rlnode.sdk.http import ApiError
from rlnode.sdk.jobs import new_job_id, parse_config
from rlnode.sdk.vault import VaultClient
from rlnode.service.auth import Scope, bearer_token
from rlnode_services.checkpoint_server.access import Caller, need, org_of
from rlnode_services.checkpoint_server.listings import job_summary
from rlnode_services.checkpoint_server.models import ModelProblem
from rlnode_services.checkpoint_server.store import RolloutSampleRecord

PAGE_DIR = Path(__file__).parent / "dashboard"
VENDOR_FILES = ("uPlot.iife.min.js", "uPlot.min.css")
ENDED = ENDED_STATUSES | {"rejected"}  # nothing left to cancel


class StartRequest(BaseModel):
    """A job to start: its config as the TOML (or JSON) text of a job file."""

    config: str = Field(min_length=1, max_length=200_000, description="The job file's text.")
    format: str = Field("toml", pattern="^(toml|json)$")
    job_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")


class CancelRequest(BaseModel):
    reason: str | None = Field(None, max_length=500)


def dashboard_routes(db: Engine, bus: Bus, vault_url: str, gateway_url: str) -> APIRouter:
    router = APIRouter()

    async def request_job(request: Request, job_id: str, org_id: str, **body: Any) -> None:
        """Publish a job request as the SDK does: with a single-use job token the vault
        mints from the caller's own org token (the org token goes no further)."""
        token = _caller_token(request)

        def mint() -> str:
            with VaultClient(vault_url, token) as vault:
                return vault.create_job_token(job_id, org_id)

        try:
            job_token = await asyncio.to_thread(mint)
        except ApiError as e:
            raise ModelProblem(e.status or 503, e.message, "vault_error") from None
        await bus.publish(JobRequest(job_id=job_id, org_id=org_id, token=job_token, **body))

    @router.post("/v1/jobs", tags=["jobs"], status_code=202)
    async def start(claims: Caller, request: Request, body: StartRequest) -> dict[str, str]:
        """Start a job from a job file's text: 422 naming what is wrong in it (nothing is
        published); 202 with the job id once the request is on its way to the learner,
        whose `job.accepted` or `job.rejected` follows on the job's events."""
        need(claims, Scope.JOBS_WRITE)
        try:
            config = parse_config(body.config, toml=body.format == "toml")
        except ValidationError as e:
            raise ModelProblem(422, describe_validation_error(e, "job config")) from None
        except ValueError as e:  # TOML or JSON syntax: the parser names the line
            raise ModelProblem(
                422, f"the job config cannot be read as {body.format}: {e}"
            ) from None
        job_id = body.job_id or new_job_id()
        await request_job(request, job_id, org_of(claims), config=config)
        return {"job_id": job_id}

    @router.post("/v1/jobs/{job_id}/cancel", tags=["jobs"], status_code=202)
    async def cancel(
        claims: Caller, request: Request, job_id: str, body: CancelRequest | None = None
    ) -> dict[str, str]:
        """Ask the learner to cancel a job of your org; `job.cancelled` follows."""
        need(claims, Scope.JOBS_WRITE)
        summary = job_summary(db, claims, job_id)
        if summary.status in ENDED:
            raise ModelProblem(409, f"job {job_id} has ended already ({summary.status})")
        reason = (body.reason if body else None) or "cancelled from the dashboard"
        await request_job(request, job_id, summary.org_id, action=JobAction.CANCEL, reason=reason)
        return {"job_id": job_id}

    @router.get("/v1/jobs/{job_id}/rollouts", tags=["jobs"])
    async def rollouts(
        claims: Caller,
        job_id: str,
        step: Annotated[int | None, Query(ge=0)] = None,
        min_reward: Annotated[float | None, Query()] = None,
        max_reward: Annotated[float | None, Query()] = None,
        status: Annotated[str | None, Query(pattern="^(ok|failed)$")] = None,
        text: Annotated[str | None, Query(max_length=200)] = None,
        limit: Annotated[int, Query(ge=1, le=500)] = 100,
    ) -> list[dict[str, Any]]:
        """The episodes the learner showed of each step (`rollout.sample`), newest step
        first: by step, reward range, status, or text in a prompt, completion or failure."""
        job_summary(db, claims, job_id)
        query = select(RolloutSampleRecord).where(
            RolloutSampleRecord.job_id == job_id,
            RolloutSampleRecord.org_id == org_of(claims),
        )
        if step is not None:
            query = query.where(RolloutSampleRecord.step == step)
        if min_reward is not None:
            query = query.where(col(RolloutSampleRecord.reward) >= min_reward)
        if max_reward is not None:
            query = query.where(col(RolloutSampleRecord.reward) <= max_reward)
        if status is not None:
            query = query.where(RolloutSampleRecord.status == status)
        if text:
            query = query.where(col(RolloutSampleRecord.episode).icontains(text, autoescape=True))
        query = query.order_by(
            col(RolloutSampleRecord.step).desc(), col(RolloutSampleRecord.position)
        ).limit(limit)
        with Session(db) as s:
            rows = s.exec(query).all()
        return [{"step": r.step, "position": r.position, **orjson.loads(r.episode)} for r in rows]

    @router.get("/v1/node", tags=["node"])
    async def node(claims: Caller, request: Request) -> dict[str, Any]:
        """The node as its supervisor records it (each service's health and restarts, the
        GPU plan) and your org's Task Apps with their verify state."""
        need(claims, Scope.JOBS_READ)
        settings = request.app.state.settings
        state = _node_state(settings.node.data_dir)
        # What an org's user may see of each: not pids nor health URLs.
        shown = ("service", "url", "running", "restarts", "healthy", "problem")
        services = [
            {field: row.get(field) for field in shown}
            for row in await services_health(state.get("services", {}))
        ]
        token = _caller_token(request)
        return {
            "supervised": bool(state),
            "broker_restarts": state.get("broker_restarts", 0),
            "plan": state.get("plan", []),
            "services": list(services),
            "task_apps": await asyncio.to_thread(_task_apps, gateway_url, token, org_of(claims)),
        }

    @router.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    @router.get("/dashboard/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(PAGE_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/{name}", include_in_schema=False)
    async def asset(name: str) -> FileResponse:
        return FileResponse(_asset(name), headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/vendor/{name}", include_in_schema=False)
    async def vendor(name: str) -> FileResponse:
        if name not in VENDOR_FILES:
            raise ModelProblem(404, f"no file {name!r}", "not_found_error")
        path = PAGE_DIR / "vendor" / name
        if not path.exists():
            raise ModelProblem(
                404,
                f"{name} is not installed: run `make setup` (it puts uPlot there)",
                "not_found_error",
            )
        return FileResponse(path)

    return router


def _caller_token(request: Request) -> str:
    token = bearer_token(request.headers.get("authorization"))
    assert token is not None, "Caller admitted the request: it has a bearer token"
    return token


def _asset(name: str) -> Path:
    """One of the page's own files (never a path from the URL)."""
    files = {p.name: p for p in PAGE_DIR.iterdir() if p.is_file()}
    if name not in files:
        raise ModelProblem(404, f"the dashboard has no file {name!r}", "not_found_error")
    return files[name]


def _node_state(data_dir: Path) -> dict[str, Any]:
    """node.json, which the node's supervisor keeps (empty when no supervisor writes one:
    services started one by one)."""
    try:
        return json.loads(state_path(data_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _task_apps(gateway_url: str, token: str, org_id: str) -> list[dict[str, Any]] | dict[str, str]:
    """The org's Task Apps as the gateway lists them, each with a verify run now (healthy,
    accepts the org's key, refuses a wrong one)."""
    if not gateway_url:
        return {"error": "no taskapp-gateway is set (CHECKPOINT_SERVER_GATEWAY_URL)"}
    try:
        with GatewayClient(gateway_url, token) as gateway:
            apps = gateway.list(org_id)
            for app in apps:
                try:
                    app["verify"] = gateway.verify(app["name"], org_id)
                except ApiError as e:
                    app["verify"] = {"ok": False, "error": e.message}
            return apps
    except ApiError as e:
        return {"error": e.message}
