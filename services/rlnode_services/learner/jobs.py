"""The learner as job owner: requests in, verdicts out, runners started, queued, cancelled
and resumed after a restart; trajectories routed to their runner, and their offsets
committed only once a checkpoint covers them."""

from __future__ import annotations

import json
import logging

from aiokafka.errors import KafkaError
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session, col, select

from rlnode.bus import Bus, Delivery, Subscription
from rlnode.bus.signing import RecordRefused
from rlnode.messages import (
    JobConfig,
    JobEvent,
    JobEventType,
    JobRequest,
    Trajectory,
    topics,
    utc_now,
)
from rlnode.messages.jobs import (
    AcceptedData,
    CompletedData,
    EndedData,
    EventData,
    RejectedData,
)
from rlnode.service.db import create_tables, session_scope
from rlnode.service.db_outage import message as outage_message
from rlnode.service.db_outage import unreachable
from rlnode.service.supervised import Background
from rlnode.training.loop import JobCancelled, JobFailed, JobRunner
from rlnode.training.rank_hosts import RankHub
from rlnode.training.transport import BusTransport
from rlnode_services.learner.intake import JobIntake
from rlnode_services.learner.org_topics import OrgTopics
from rlnode_services.learner.probe import task_app_probe
from rlnode_services.learner.settings import LearnerSettings
from rlnode_services.learner.store import ACTIVE, TABLES, JobRecord
from rlnode_services.learner.weights import PublishedWeights

log = logging.getLogger("learner.jobs")


class JobManager:
    def __init__(
        self, settings: LearnerSettings, bus: Bus, engine: Engine, intake: JobIntake
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.engine = engine
        self.intake = intake
        # The weight versions published, which generators on other hosts fetch over HTTP.
        self.published = PublishedWeights()
        self.transport = self.published.noting(BusTransport(bus))
        self.runners: dict[str, JobRunner] = {}
        # One supervised driver per running job ("job <id>"): /health names a driver that
        # died, and it starts again (the job resumes from its last checkpoint).
        self.drivers = Background()
        self.holding: set[str] = set()  # jobs whose driver runs or waits to run again
        # Other hosts' training ranks join through the rendezvous this learner hosts for as
        # long as it runs (rlnode.training.rank_hosts).
        self.rank_hosts = (
            RankHub(
                settings.rendezvous,
                settings.rank_host_list,
                join_timeout_s=settings.rank_join_timeout_s,
                timeout_s=settings.rank_timeout_s,
                interface=settings.socket_ifname,
            )
            if settings.rank_host_list and settings.rendezvous
            else None
        )
        # A data-parallel job holds the process group (one per process): one job at a time.
        parallel = len(settings.device_list) > 1 or self.rank_hosts is not None
        self.capacity = 1 if parallel else settings.max_running_jobs
        self.trajectories: Subscription[Trajectory] | None = None
        self.org_topics = OrgTopics(bus.settings)
        create_tables(engine, *TABLES)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Resume the jobs this learner owned, then read trajectories (runners first, so
        that none of theirs is read before they can take it)."""
        with Session(self.engine) as s:
            active = list(
                s.exec(
                    select(JobRecord)
                    .where(col(JobRecord.status).in_(ACTIVE))
                    .order_by(col(JobRecord.created_at))
                )
            )
        for record in active:  # jobs this learner owned before it stopped
            await self.org_topics.ensure(record.org_id)
            await self._start_or_queue(record)
        self.trajectories = self.bus.subscribe(
            topics.TRAJECTORIES,
            self.on_trajectory,
            group_id=self.settings.trajectory_group_id,
            commit="when_settled",
            tag=lambda t: (t.job_id, t.step),
            settled=self._settled,
            fetch_max_wait_ms=self.bus.settings.rollout_fetch_max_wait_ms,
        )
        await self.trajectories.start()

    async def stop(self) -> None:
        """Stop the runners (their jobs stay running and resume on restart); the bus stops
        the subscriptions."""
        await self.drivers.stop()

    # -- requests -------------------------------------------------------------------------

    async def on_request(self, request: JobRequest, _delivery: Delivery) -> None:
        verdict = await self.intake.check(request)
        if verdict.org_verified:  # before the org's first event about it: where it is copied
            await self.org_topics.ensure(request.org_id)
        if not verdict.ok:
            await self._reject(request, verdict.reason)
            return
        if request.action == "cancel":
            await self._cancel(request)
            return
        config = request.config
        assert config is not None, "a 'start' request has a config (JobRequest validates it)"
        with Session(self.engine) as s:
            existing = s.get(JobRecord, request.job_id)
        if existing is not None and verdict.repeated:
            # This request, handled again after a failure (a database outage): the record is
            # its own; go on from where it stopped.
            if existing.status == "queued" and existing.job_id not in self.holding:
                await self._start_or_queue(existing)
            return
        if existing is not None:
            reason = (
                f"job id {request.job_id!r} was used already ({existing.status}); choose another"
            )
            await self._reject(request, reason)
            return
        record = JobRecord(
            job_id=request.job_id,
            org_id=request.org_id,
            config=json.dumps(config.model_dump(mode="json")),
            status="queued",
        )
        with session_scope(self.engine) as s:
            s.add(record)
        await self._event(
            record.job_id,
            record.org_id,
            JobEventType.ACCEPTED,
            "accepted",
            AcceptedData(
                steps=config.training.steps,
                name=config.name,
                model=config.model.source,
                task_app=config.task_app.name,
                algorithm=config.training.algorithm,
            ),
        )
        await self._start_or_queue(record)

    async def _start_or_queue(self, record: JobRecord) -> None:
        if len(self.holding) >= self.capacity:
            await self._event(
                record.job_id,
                record.org_id,
                JobEventType.QUEUED,
                f"queued behind {len(self.holding)} running job(s)",
            )
            return
        job_id = record.job_id
        self._set(job_id, status="running")
        self.holding.add(job_id)
        self.drivers.run(f"job {job_id}", lambda: self._drive(job_id))

    def _runner(self, record: JobRecord) -> JobRunner:
        job_id = record.job_id
        config = JobConfig.model_validate_json(record.config)
        return JobRunner(
            job_id,
            record.org_id,
            config,
            self.transport,
            self.settings.node.checkpoint_dir,
            self.settings.device_list,
            self.settings.step_timeout_s,
            source=self.bus.service,
            on_progress=lambda step: self._note_progress(job_id, step),
            reference_device=self.settings.reference_device,
            weights_dir=self.settings.node.weights_store,
            weights_dtype=self.settings.engine_dtype,
            max_checkpoint_bytes=self.settings.max_checkpoint_bytes,
            disk_full_wait_s=self.settings.disk_full_wait_s,
            samples_per_work=self.settings.samples_per_work,
            model_store=self.settings.node.model_dir,
            rank_hosts=self.rank_hosts,
            collective_timeout_s=self.settings.rank_timeout_s,
            probe=task_app_probe(self.settings, record.org_id, config.task_app.name),
        )

    async def _drive(self, job_id: str) -> None:
        """Run a job from its last checkpoint to its verdict, then start a queued job. If
        this raises (the verdict could not be published or recorded), supervision runs it
        again: it resumes from its last checkpoint and reaches its verdict again."""
        with Session(self.engine) as s:
            record = s.get(JobRecord, job_id)
        if record is not None and record.status in ACTIVE:
            runner = self._runner(record)
            self.runners[job_id] = runner
            try:
                await self._end(runner, *await self._outcome(runner))
            finally:
                self.runners.pop(job_id, None)
                self.published.forget(job_id)
                await runner.close_trackers()
        self.holding.discard(job_id)
        await self._commit()
        await self._start_next_queued()

    async def _outcome(self, runner: JobRunner) -> tuple[JobEventType, str, EventData]:
        try:
            await runner.run()
        except JobCancelled:
            reason = runner.cancel_reason
            message = f"cancelled at step {runner.step}: {reason}"
            return JobEventType.CANCELLED, message, EndedData(reason=reason, step=runner.step)
        except JobFailed as e:
            return JobEventType.FAILED, str(e), EndedData(reason=str(e), step=runner.step)
        except Exception as e:
            log.exception("job %s failed", runner.job_id)
            reason = f"the learner failed: {type(e).__name__}: {e}"
            return JobEventType.FAILED, reason, EndedData(reason=reason, step=runner.step)
        message = f"completed {runner.step} steps"
        return JobEventType.COMPLETED, message, CompletedData(steps=runner.step)

    async def _start_next_queued(self) -> None:
        with Session(self.engine) as s:
            queued = s.exec(
                select(JobRecord)
                .where(JobRecord.status == "queued")
                .order_by(col(JobRecord.created_at))
            ).first()
        if queued is not None and len(self.holding) < self.capacity:
            await self._start_or_queue(queued)

    async def _cancel(self, request: JobRequest) -> None:
        with Session(self.engine) as s:
            record = s.get(JobRecord, request.job_id)
        if record is None or record.org_id != request.org_id:
            reason = f"no job {request.job_id!r} to cancel"
            await self._reject(request, reason)
        elif request.job_id in self.runners:
            self.runners[request.job_id].cancel(request.reason)
        elif record.status == "queued":
            self._set(record.job_id, status="cancelled")
            await self._event(
                record.job_id,
                record.org_id,
                JobEventType.CANCELLED,
                "cancelled before it started",
                EndedData(reason=request.reason or "cancelled by request", step=0),
            )
        else:
            reason = f"job {request.job_id!r} is {record.status} already; nothing to cancel"
            await self._reject(request, reason)

    # -- trajectories ---------------------------------------------------------------------

    async def on_trajectory(self, trajectory: Trajectory, _delivery: Delivery) -> None:
        runner = self.runners.get(trajectory.job_id)
        if runner is None:
            return
        if trajectory.org_id != runner.org_id:
            raise RecordRefused(
                f"a trajectory of job {trajectory.job_id} names org {trajectory.org_id!r}; "
                f"the job is {runner.org_id!r}'s"
            )
        runner.offer(trajectory)

    def _settled(self, tag: tuple[str, int]) -> bool:
        """Whether a trajectory of (job, step) needs reading again after a restart: not
        when a checkpoint covers its step, nor when its job is done with or unknown."""
        job_id, step = tag
        runner = self.runners.get(job_id)
        if runner is not None:
            return runner.settled(step)
        with Session(self.engine) as s:
            record = s.get(JobRecord, job_id)
        # A job that is not running here: done with, unknown, or queued (then keep it).
        return record is None or record.status not in ACTIVE

    async def _commit(self) -> None:
        """Commit at once what a job that just ended settled (the subscription commits
        after every fetch too, so a refused commit is only logged)."""
        if self.trajectories is None:
            return
        try:
            await self.trajectories.commit()
        except KafkaError as e:
            log.warning("committing trajectories failed (%s); read again after a restart", e)

    # -- helpers -----------------------------------------------------------------------------

    async def _reject(self, request: JobRequest, reason: str) -> None:
        # A refused cancel says so: watchers must not take it for the job's verdict.
        await self._event(
            request.job_id,
            request.org_id,
            JobEventType.REJECTED,
            reason,
            RejectedData(reason=reason, action=request.action),
        )

    async def _end(
        self, runner: JobRunner, kind: JobEventType, message: str, data: EventData
    ) -> None:
        """Record how a job ended (its status and, unless it completed, the reason) and
        publish the matching terminal event."""
        status = {
            JobEventType.CANCELLED: "cancelled",
            JobEventType.FAILED: "failed",
            JobEventType.COMPLETED: "completed",
        }[kind]
        changes = {"reason": message} if kind is JobEventType.FAILED else {}
        # Published first: if recording fails, the driver runs again and says it again.
        verdict = JobEvent.of(runner.job_id, runner.org_id, self.bus.service, kind, message, data)
        await self.bus.publish(verdict)
        await runner.close_trackers(verdict)
        self._set(runner.job_id, status=status, **changes)

    def _note_progress(self, job_id: str, step: int) -> None:
        """Best effort: a database outage must not fail a training job over a progress
        figure (the next step, or the verdict, records it)."""
        try:
            self._set(job_id, step=step)
        except SQLAlchemyError as e:
            if not unreachable(e):
                raise
            log.warning("job %s: step %d not recorded: %s", job_id, step, outage_message(e))

    def _set(self, job_id: str, **changes) -> None:
        with session_scope(self.engine) as s:
            record = s.get(JobRecord, job_id)
            if record is not None:
                for k, v in changes.items():
                    setattr(record, k, v)
                record.updated_at = utc_now()
                s.add(record)

    async def _event(
        self,
        job_id: str,
        org_id: str,
        kind: JobEventType,
        message: str,
        data: EventData | None = None,
    ) -> None:
        await self.bus.publish(JobEvent.of(job_id, org_id, self.bus.service, kind, message, data))
