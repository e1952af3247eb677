"""Weight versions over HTTP, for rollout-generators that cannot see the learner's files
(another host): `GET /v1/weights/{org_id}/{job_id}/{version}`.

Only what this learner published is served: each `WeightVersion` is noted as it goes out
(a job's notes go when its run ends), and a request names a version by org, job and number,
never by path. The file is the one the record names, resolved inside the node's stores
under `<org>/<job>/` (`rlnode.service.stores`), and must still hold the bytes the record
says; anything else is 404. The caller needs a service token with `weights:read` (the
rollout-generator's and checkpoint-server's carry it; org tokens cannot). The answer is
streamed, with one byte range on request (a broken download resumes) and the record's
BLAKE3 digest as its ETag (rlnode.service.ranges)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException
from fastapi import Path as PathParam
from fastapi.responses import Response

from rlnode.messages import ID_PATTERN, JobEvent, RolloutWork, WeightVersion
from rlnode.service.auth import Scope, TokenVerifier
from rlnode.service.http import Caller
from rlnode.service.ranges import quoted_etag, ranged_file
from rlnode.service.stores import path_in_job_store
from rlnode.training.transport import JobTransport

log = logging.getLogger("learner.weights")

# Versions remembered per job: the loop keeps max_async + 2 files, far fewer than this.
KEPT_PER_JOB = 64


class PublishedWeights:
    """The weight versions this learner published, per job: what the route may serve."""

    def __init__(self, kept_per_job: int = KEPT_PER_JOB) -> None:
        self.kept_per_job = kept_per_job
        self._jobs: dict[tuple[str, str], dict[int, WeightVersion]] = {}

    def note(self, version: WeightVersion) -> None:
        versions = self._jobs.setdefault((version.org_id, version.job_id), {})
        versions[version.version] = version
        for old in sorted(versions)[: -self.kept_per_job]:
            del versions[old]

    def find(self, org_id: str, job_id: str, version: int) -> WeightVersion | None:
        return self._jobs.get((org_id, job_id), {}).get(version)

    def forget(self, job_id: str) -> None:
        """The job's run ended: its versions are not served any more (the working copies in
        the weights store are gone with it)."""
        for key in [k for k in self._jobs if k[1] == job_id]:
            del self._jobs[key]

    def noting(self, transport: JobTransport) -> JobTransport:
        """`transport`, with each weight version it publishes noted here first (so a
        generator that hears of it can fetch it at once)."""
        return _NotingTransport(transport, self)


class _NotingTransport:
    def __init__(self, inner: JobTransport, published: PublishedWeights) -> None:
        self.inner, self.published = inner, published

    async def publish_work(self, work: Sequence[RolloutWork]) -> None:
        await self.inner.publish_work(work)

    async def publish_weights(self, version: WeightVersion) -> None:
        self.published.note(version)
        await self.inner.publish_weights(version)

    async def publish_event(self, event: JobEvent) -> None:
        await self.inner.publish_event(event)


Id = Annotated[str, PathParam(pattern=ID_PATTERN)]


def weights_router(published: PublishedWeights, stores: Iterable[Path]) -> APIRouter:
    stores = tuple(stores)
    router = APIRouter(tags=["weights"])

    @router.get(
        "/v1/weights/{org_id}/{job_id}/{version}",
        response_class=Response,
        responses={
            200: {"content": {"application/octet-stream": {}}},
            206: {"description": "The byte range asked for (Range: bytes=N-)."},
            416: {"description": "A range this file does not have."},
        },
    )
    async def weights(
        claims: Caller,
        org_id: Id,
        job_id: Id,
        version: Annotated[int, PathParam(ge=0)],
        range_: Annotated[str | None, Header(alias="Range")] = None,
        if_range: Annotated[str | None, Header(alias="If-Range")] = None,
    ) -> Response:
        """A weight version's safetensors file, as the learner published it for the job
        (service tokens with weights:read; `Range: bytes=N-` resumes; ETag: its BLAKE3)."""
        TokenVerifier.authorize_claims(claims, scopes=[Scope.WEIGHTS_READ], org_id=org_id)
        record = published.find(org_id, job_id, version)
        missing = HTTPException(
            404, f"no weight version {version} of job {job_id} is published by this learner"
        )
        if record is None:
            raise missing
        path = path_in_job_store(record.uri, stores, org_id, job_id)
        if path is None:  # the learner writes nowhere else; a record of that is a bug
            log.error("weights v%d of %s lie outside the stores: %s", version, job_id, record.uri)
            raise missing
        try:
            file = path.open("rb")
        except OSError:  # pruned, or the run ended
            raise missing from None
        size = os.fstat(file.fileno()).st_size
        if size != record.size_bytes:
            file.close()
            log.error(
                "weights v%d of %s hold %d bytes, not %d", version, job_id, size, record.size_bytes
            )
            raise missing
        return ranged_file(file, size, quoted_etag(record.blake3), range_, if_range)

    return router
