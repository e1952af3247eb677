"""A job's events over HTTP, for users of a shared node who may not read the job-events
topic (it holds every org's): server-sent events of one job of the caller's org, each
checked like the SDK checks them (signed by a service that may produce it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from sqlalchemy.engine import Engine
from sqlmodel import Session

from rlnode.bus.settings import KafkaSettings
from rlnode.bus.signing import RecordVerifier
from rlnode.sdk.jobs import job_events
from rlnode.service.auth import Scope
from rlnode_services.checkpoint_server.access import Caller, need, org_of
from rlnode_services.checkpoint_server.models import ModelProblem
from rlnode_services.checkpoint_server.store import JobSummary


def event_routes(db: Engine, kafka: KafkaSettings, verifier: RecordVerifier) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/jobs/{job_id}/events", tags=["jobs"])
    async def events(
        claims: Caller, job_id: str, follow: Annotated[bool, Query()] = True
    ) -> StreamingResponse:
        """`text/event-stream`: one `event: <type>` / `data: <JobEvent JSON>` per event, from
        the job's first, until it ends (`follow`) or until those there now are sent."""
        need(claims, Scope.JOBS_READ)
        org_id = org_of(claims)
        with Session(db) as s:
            summary = s.get(JobSummary, job_id)
        if summary is None or summary.org_id != org_id:
            raise ModelProblem(
                404,
                f"no job {job_id!r} in your org (a job just started shows up with its first event)",
                "not_found_error",
            )

        async def stream() -> AsyncIterator[bytes]:
            async for event in job_events(
                kafka, verifier, job_id, service="checkpoint-server/events", follow=follow
            ):
                if event.org_id != org_id:
                    continue
                yield f"event: {event.type.value}\ndata: {event.model_dump_json()}\n\n".encode()

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-store"}
        )

    return router
