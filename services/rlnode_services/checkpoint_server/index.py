"""Indexing the topics: checkpoints (from `checkpoint.saved` events), evaluation rounds
(`eval.completed`), weight versions, and a per-job summary; every `train.step` is also
appended to the job's metrics.jsonl.

Replays are harmless: records are upserted by key, and a metrics line is written only for a
step beyond the last one written."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from sqlalchemy.engine import Engine

from rlnode.bus import Delivery
from rlnode.messages import ENDED_STATUSES, JobEvent, JobEventType, WeightVersion, utc_now
from rlnode.messages.jobs import AcceptedData, EvalCompletedData, RolloutSampleData
from rlnode.service.db import session_scope
from rlnode.service.stores import job_dir, path_in_job_store
from rlnode_services.checkpoint_server.store import (
    CheckpointRecord,
    EvalRecord,
    JobDescription,
    JobSummary,
    RolloutSampleRecord,
    WeightRecord,
)

log = logging.getLogger("checkpoint_server.index")

STATUS_OF = {
    JobEventType.ACCEPTED: "accepted",
    JobEventType.QUEUED: "queued",
    JobEventType.STARTED: "running",
    JobEventType.PAUSED: "paused",  # the Task App breaker tripped (reason: why)
    JobEventType.RESUMED: "running",
    JobEventType.COMPLETED: "completed",
    JobEventType.FAILED: "failed",
    JobEventType.CANCELLED: "cancelled",
}


def local_path(uri: str, root: Path, org_id: str, job_id: str) -> Path | None:
    """The file a `file://` URI names, if it lies in the checkpoint store under the org and
    job the record names (a record must not make this server read files elsewhere)."""
    return path_in_job_store(uri, [root], org_id, job_id)


class Indexer:
    def __init__(self, engine: Engine, checkpoint_root: Path) -> None:
        self.engine = engine
        self.root = checkpoint_root

    async def on_event(self, event: JobEvent, _delivery: Delivery) -> None:
        if event.type is JobEventType.CHECKPOINT_SAVED:
            self._checkpoint(event)
        if event.type is JobEventType.EVAL_COMPLETED:
            self._evaluation(event)
        if event.type is JobEventType.ACCEPTED:
            self._describe(event)
        if event.type is JobEventType.ROLLOUT_SAMPLE:
            self._rollout_sample(event)
        self._summarise(event)

    async def on_weights(self, version: WeightVersion, _delivery: Delivery) -> None:
        if local_path(version.uri, self.root, version.org_id, version.job_id) is None:
            # The learner writes weight versions to /dev/shm when it has room: working
            # copies, pruned as training goes on, not artefacts to index (checkpoints are).
            log.debug(
                "weights of %s not indexed (outside the store): %s", version.job_id, version.uri
            )
            return
        with session_scope(self.engine) as s:
            s.merge(
                WeightRecord(
                    job_id=version.job_id,
                    version=version.version,
                    org_id=version.org_id,
                    step=version.step,
                    uri=version.uri,
                    blake3=version.blake3,
                    size_bytes=version.size_bytes,
                    created_at=version.ts,
                )
            )

    def _checkpoint(self, event: JobEvent) -> None:
        uri, step = event.data.get("uri"), event.data.get("step")
        if not isinstance(uri, str) or not isinstance(step, int):
            log.warning("checkpoint.saved of %s without uri/step: %s", event.job_id, event.data)
            return
        if local_path(uri, self.root, event.org_id, event.job_id) is None:
            log.warning(
                "checkpoint of %s outside its place in the store (%s/%s/): %s",
                event.job_id,
                event.org_id,
                event.job_id,
                uri,
            )
            return
        with session_scope(self.engine) as s:
            s.merge(
                CheckpointRecord(
                    job_id=event.job_id,
                    step=step,
                    org_id=event.org_id,
                    uri=uri,
                    final=bool(event.data.get("final", False)),
                    created_at=event.ts,
                )
            )

    def _evaluation(self, event: JobEvent) -> None:
        data = event.typed_data()
        assert isinstance(data, EvalCompletedData), "JobEvent checks data against its type"
        with session_scope(self.engine) as s:
            s.merge(
                EvalRecord(
                    job_id=event.job_id,
                    step=data.step,
                    org_id=event.org_id,
                    version=data.version,
                    seeds=data.seeds,
                    samples_per_seed=data.samples_per_seed,
                    count=data.count,
                    failed=data.failed,
                    reward_mean=data.reward_mean,
                    reward_std=data.reward_std,
                    pass_at_1=data.pass_at_1,
                    pass_at_k=data.pass_at_k,
                    created_at=event.ts,
                )
            )

    def _describe(self, event: JobEvent) -> None:
        data = event.typed_data()
        assert isinstance(data, AcceptedData), "JobEvent checks data against its type"
        with session_scope(self.engine) as s:
            if _another_orgs(s.get(JobDescription, event.job_id), event):
                return
            s.merge(
                JobDescription(
                    job_id=event.job_id,
                    org_id=event.org_id,
                    name=data.name,
                    model=data.model,
                    task_app=data.task_app,
                    algorithm=data.algorithm,
                )
            )

    def _rollout_sample(self, event: JobEvent) -> None:
        data = event.typed_data()
        assert isinstance(data, RolloutSampleData), "JobEvent checks data against its type"
        with session_scope(self.engine) as s:
            if _another_orgs(s.get(JobSummary, event.job_id), event):
                return
            for position, episode in enumerate(data.samples):
                s.merge(
                    RolloutSampleRecord(
                        job_id=event.job_id,
                        step=data.step,
                        position=position,
                        org_id=event.org_id,
                        reward=episode.reward,
                        status=episode.status,
                        failure_kind=episode.failure_kind,
                        episode=episode.model_dump_json(),
                        created_at=event.ts,
                    )
                )

    def _summarise(self, event: JobEvent) -> None:
        with session_scope(self.engine) as s:
            summary = s.get(JobSummary, event.job_id)
            if summary is None:
                if event.type is JobEventType.REJECTED:
                    summary = JobSummary(
                        job_id=event.job_id,
                        org_id=event.org_id,
                        status="rejected",
                        reason=str(event.data.get("reason", event.message))[:2000],
                        created_at=event.ts,
                    )
                    if event.data.get("action", "start") == "start":
                        s.add(summary)
                    return
                summary = JobSummary(job_id=event.job_id, org_id=event.org_id, status="accepted")
                summary.created_at = event.ts
            if _another_orgs(summary, event):
                return
            status = STATUS_OF.get(event.type)
            if status is not None and summary.status not in ENDED_STATUSES:
                summary.status = status
            if event.type is JobEventType.ACCEPTED:
                summary.total_steps = event.data.get("steps", summary.total_steps)
            if event.type in (JobEventType.FAILED, JobEventType.CANCELLED):
                summary.reason = str(event.data.get("reason", event.message))[:2000]
            if event.type is JobEventType.PAUSED and summary.status == "paused":
                summary.reason = event.message[:2000]
            if event.type is JobEventType.RESUMED and summary.status == "running":
                summary.reason = None
            if event.type is JobEventType.TRAIN_STEP:
                step = int(event.data.get("step", 0))
                if step > summary.step:
                    self._append_metrics(event)
                    summary.step = step
                    summary.total_steps = event.data.get("total_steps", summary.total_steps)
                    summary.reward_mean = event.data.get("reward_mean")
                    summary.loss = event.data.get("loss")
            summary.updated_at = utc_now()
            s.add(summary)

    def _append_metrics(self, event: JobEvent) -> None:
        path = metrics_path(self.root, event.org_id, event.job_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        line = {"ts": event.ts.isoformat(), **event.data}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def _another_orgs(known: JobSummary | JobDescription | None, event: JobEvent) -> bool:
    """An event naming a job the index knows as another org's: not this job's."""
    return known is not None and known.org_id != event.org_id


def metrics_path(root: Path, org_id: str, job_id: str) -> Path:
    return job_dir(root, org_id, job_id) / "metrics.jsonl"
