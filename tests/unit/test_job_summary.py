"""The checkpoint-server's job summary follows the job's events: a job the Task App breaker
paused reads as paused, with why, until it resumes."""

from __future__ import annotations

import pytest
from sqlmodel import Session

from rlnode.messages import JobEvent, JobEventType
from rlnode.service.db import create_tables, make_engine
from rlnode_services.checkpoint_server.index import Indexer
from rlnode_services.checkpoint_server.store import TABLES, JobSummary

pytestmark = pytest.mark.asyncio
PAUSED = {
    "step": 3,
    "bad_steps": 2,
    "rollouts": 16,
    "failed": 16,
    "failures": {"task_app_unreachable": 16},
    "max_failed_share": 0.5,
    "give_up_after_s": 600,
}
RESUMED = {"step": 3, "paused_s": 4.0, "probes": 2, "probe": "passes"}


async def test_a_paused_job_reads_as_paused_until_it_resumes(tmp_path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'index.sqlite3'}")
    create_tables(engine, *TABLES)
    indexer = Indexer(engine, tmp_path)

    async def say(kind: JobEventType, message: str = "", **data) -> JobSummary:
        event = JobEvent(
            job_id="job-1", org_id="org", type=kind, source="learner", message=message, data=data
        )
        await indexer.on_event(event, None)  # type: ignore[arg-type]
        with Session(engine) as s:
            summary = s.get(JobSummary, "job-1")
        assert summary is not None
        return summary

    await say(JobEventType.ACCEPTED, steps=5)
    assert (await say(JobEventType.STARTED)).status == "running"
    paused = await say(JobEventType.PAUSED, "paused after step 3: 16 of 16 failed", **PAUSED)
    assert paused.status == "paused" and paused.reason == "paused after step 3: 16 of 16 failed"
    resumed = await say(JobEventType.RESUMED, "resumed", **RESUMED)
    assert resumed.status == "running" and resumed.reason is None
    await say(JobEventType.PAUSED, "paused again", **PAUSED)
    failed = await say(JobEventType.FAILED, "gave up", reason="the Task App did not recover")
    assert failed.status == "failed" and failed.reason == "the Task App did not recover"
    late = await say(JobEventType.RESUMED, "late", **RESUMED)  # a verdict is final
    assert late.status == "failed" and late.reason == "the Task App did not recover"
