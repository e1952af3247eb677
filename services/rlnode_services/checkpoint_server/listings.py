"""The checkpoint-server's read routes: your org's jobs (as their events tell), their
metrics, checkpoints and checkpoint files. Another org's job is a 404, as if absent."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from rlnode.service.auth import Scope, TokenClaims
from rlnode_services.checkpoint_server.access import Caller, need, org_of
from rlnode_services.checkpoint_server.index import local_path, metrics_path
from rlnode_services.checkpoint_server.models import (
    Checkpoints,
    ModelProblem,
    adapter_of,
    merge_checkpoint,
)
from rlnode_services.checkpoint_server.store import CheckpointRecord, JobDescription, JobSummary


def job_summary(db: Engine, claims: TokenClaims, job_id: str) -> JobSummary:
    """The caller's org's job (jobs:read), as its events tell; another org's is a 404."""
    need(claims, Scope.JOBS_READ)
    with Session(db) as s:
        row = s.get(JobSummary, job_id)
    if row is None or row.org_id != org_of(claims):
        raise ModelProblem(
            404,
            f"no job {job_id!r} in your org (a job just started shows up with its first event)",
            "not_found_error",
        )
    return row


def listing_routes(
    db: Engine, root: Path, checkpoints: Checkpoints, merged_dir: Path | None = None
) -> APIRouter:
    # LoRA checkpoints merged for download, written once each (the store is the learner's).
    merged_dir = merged_dir or Path(tempfile.gettempdir()) / "rlnode-merged-checkpoints"
    router = APIRouter()

    @router.get("/v1/checkpoints", tags=["checkpoints"])
    async def list_checkpoints(
        claims: Caller, job: Annotated[str | None, Query()] = None
    ) -> list[dict[str, Any]]:
        """Your org's checkpoints (of one job with ?job=), oldest first."""
        need(claims, Scope.JOBS_READ)
        return [
            {
                "job_id": r.job_id,
                "step": r.step,
                "model": r.model,
                "uri": r.uri,
                "final": r.final,
                "on_disk": (p := local_path(r.uri, root, r.org_id, r.job_id)) is not None
                and p.exists(),
                "created_at": r.created_at.isoformat(),
            }
            for r in checkpoints.of_job(org_of(claims), job)
        ]

    @router.get("/v1/checkpoints/{job_id}/{step}/files", tags=["checkpoints"])
    async def list_files(claims: Caller, job_id: str, step: str) -> list[dict[str, Any]]:
        need(claims, Scope.JOBS_READ)
        _record, path = checkpoints.resolve(org_of(claims), f"{job_id}@{step}")
        return [
            {"name": f.name, "size_bytes": f.stat().st_size}
            for f in sorted(path.iterdir())
            if f.is_file()
        ]

    @router.get("/v1/checkpoints/{job_id}/{step}/files/{name}", tags=["checkpoints"])
    async def download(claims: Caller, job_id: str, step: str, name: str) -> FileResponse:
        need(claims, Scope.JOBS_READ)
        _record, path = checkpoints.resolve(org_of(claims), f"{job_id}@{step}")
        files = {f.name: f for f in path.iterdir() if f.is_file()}  # never a path from the URL
        if name not in files:
            raise ModelProblem(
                404,
                f"checkpoint {job_id}@{step} has no file {name!r}; it has {', '.join(sorted(files))}",
                "not_found_error",
            )
        return FileResponse(files[name], filename=name)

    @router.get("/v1/checkpoints/{job_id}/{step}/merged/model.safetensors", tags=["checkpoints"])
    async def download_merged(claims: Caller, job_id: str, step: str) -> FileResponse:
        """A LoRA checkpoint's whole weights, base + adapters merged (its config.json and
        tokenizer are the base's)."""
        need(claims, Scope.JOBS_READ)
        record, path = checkpoints.resolve(org_of(claims), f"{job_id}@{step}")
        if adapter_of(path, record.model) is None:
            raise ModelProblem(
                400,
                f"checkpoint {record.model} holds whole weights, not LoRA adapters: download "
                f"its files (GET /v1/checkpoints/{job_id}/{step}/files)",
            )
        out = merged_dir / record.org_id / record.job_id / f"step-{record.step:06d}"
        merged = await asyncio.to_thread(merge_checkpoint, path, out)
        return FileResponse(merged, filename="model.safetensors")

    @router.get("/v1/models", tags=["inference"])
    async def models(claims: Caller) -> dict[str, Any]:
        """OpenAI's model list: every checkpoint, and `<job>@latest` per job."""
        need(claims, Scope.INFERENCE)
        data, latest = [], {}
        for r in checkpoints.of_job(org_of(claims), None):
            entry = {
                "id": r.model,
                "object": "model",
                "created": int(r.created_at.timestamp()),
                "owned_by": r.org_id,
            }
            data.append(entry)
            latest[r.job_id] = {**entry, "id": f"{r.job_id}@latest"}
        return {"object": "list", "data": data + list(latest.values())}

    @router.get("/v1/jobs", tags=["jobs"])
    async def jobs(claims: Caller) -> list[dict[str, Any]]:
        """Your org's jobs, newest first, as their events tell."""
        need(claims, Scope.JOBS_READ)
        with Session(db) as s:
            rows = s.exec(
                select(JobSummary)
                .where(JobSummary.org_id == org_of(claims))
                .order_by(col(JobSummary.created_at).desc())
            ).all()
            described = {
                d.job_id: d
                for d in s.exec(
                    select(JobDescription).where(JobDescription.org_id == org_of(claims))
                ).all()
            }
        return [_summary(r, described.get(r.job_id)) for r in rows]

    @router.get("/v1/jobs/{job_id}", tags=["jobs"])
    async def job(claims: Caller, job_id: str) -> dict[str, Any]:
        row = job_summary(db, claims, job_id)
        with Session(db) as s:
            ckpts = s.exec(select(CheckpointRecord).where(CheckpointRecord.job_id == job_id)).all()
            description = s.get(JobDescription, job_id)
        best = None
        if ckpts:
            try:
                best = checkpoints.best(org_of(claims), job_id, list(ckpts)).step
            except ModelProblem:
                best = None  # no round evaluated a checkpoint (yet)
        return {
            **_summary(row, description),
            "checkpoints": sorted(c.step for c in ckpts),
            "best_checkpoint": best,
        }

    @router.get("/v1/jobs/{job_id}/evals", tags=["jobs"])
    async def evaluations(claims: Caller, job_id: str) -> list[dict[str, Any]]:
        """The job's evaluation rounds (eval.completed), by step."""
        job_summary(db, claims, job_id)
        return [e.listed() for e in checkpoints.evaluations(org_of(claims), job_id)]

    @router.get("/v1/jobs/{job_id}/metrics", tags=["jobs"])
    async def metrics(claims: Caller, job_id: str) -> FileResponse:
        """Every train.step of the job, one JSON object per line."""
        await job(claims, job_id)
        path = metrics_path(root, org_of(claims), job_id)
        if not path.exists():
            raise ModelProblem(404, f"job {job_id!r} has no training steps yet", "not_found_error")
        return FileResponse(path, media_type="application/x-ndjson")

    return router


def _summary(row: JobSummary, description: JobDescription | None) -> dict[str, Any]:
    known = description if description is not None and description.org_id == row.org_id else None
    return {
        "job_id": row.job_id,
        "name": known.name if known else None,
        "model": known.model if known else None,
        "task_app": known.task_app if known else None,
        "algorithm": known.algorithm if known else None,
        "status": row.status,
        "step": row.step,
        "total_steps": row.total_steps,
        "reward_mean": row.reward_mean,
        "loss": row.loss,
        "reason": row.reason,
        "created_at": row.created_at.isoformat(),
        "updated_at": row.updated_at.isoformat(),
    }
