"""A job's events over HTTP, for users of a shared node who may not read the job-events
topic (it holds every org's): server-sent events of one job of the caller's org, each
checked like the SDK checks them (signed by a service that may produce it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from sqlalchemy.engine import Engine

from rlnode.bus.settings import KafkaSettings
from rlnode.bus.signing import RecordVerifier
from rlnode.messages import JobEvent
from rlnode.sdk.jobs import job_events, org_events
from rlnode.service.auth import Scope
from rlnode_services.checkpoint_server.access import Caller, need, org_of
from rlnode_services.checkpoint_server.listings import job_summary


def event_routes(db: Engine, kafka: KafkaSettings, verifier: RecordVerifier) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/jobs/{job_id}/events", tags=["jobs"])
    async def events(
        claims: Caller, job_id: str, follow: Annotated[bool, Query()] = True
    ) -> StreamingResponse:
        """`text/event-stream`: one `event: <type>` / `data: <JobEvent JSON>` per event, from
        the job's first, until it ends (`follow`) or until those there now are sent."""
        org_id = job_summary(db, claims, job_id).org_id

        async def stream() -> AsyncIterator[bytes]:
            async for event in job_events(
                kafka, verifier, job_id, service="checkpoint-server/events", follow=follow
            ):
                if event.org_id == org_id:
                    yield sse(event)

        return event_stream(stream())

    @router.get("/v1/events", tags=["jobs"])
    async def org_stream(claims: Caller) -> StreamingResponse:
        """`text/event-stream`: every event of your org's jobs from now on, as they come
        (the dashboard's job list follows it)."""
        need(claims, Scope.JOBS_READ)
        org_id = org_of(claims)

        async def stream() -> AsyncIterator[bytes]:
            yield b": following your org's job events\n\n"  # the headers go out now
            async for event in org_events(
                kafka, verifier, org_id, service="checkpoint-server/events", from_beginning=False
            ):
                yield sse(event)

        return event_stream(stream())

    return router


def sse(event: JobEvent) -> bytes:
    return f"event: {event.type.value}\ndata: {event.model_dump_json()}\n\n".encode()


def event_stream(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        body, media_type="text/event-stream", headers={"Cache-Control": "no-store"}
    )
