"""Taking rollout work: each item a group's samples (many in flight, bounded by the
subscription's concurrency and the runner's slots), their trajectories published before the
item counts as done. The bus commits a
partition's offset only over a contiguous run of done items, so what is in flight when a
generator dies is delivered again to another one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial

from rlnode.bus import Bus, Delivery, RecordTooLarge
from rlnode.messages import JobEvent, JobEventType, RolloutFailure, RolloutWork, Trajectory
from rlnode.messages.jobs import TrajectoryTooLargeData
from rlnode_services.rollout_generator.finished import FinishedJobs

log = logging.getLogger("rollout_generator.work")


class WorkHandler:
    def __init__(
        self,
        bus: Bus,
        run_rollouts: Callable[[RolloutWork], Awaitable[list[Trajectory]]],
        finished: FinishedJobs,
        catch_up_s: float = 30.0,
    ) -> None:
        self.bus = bus
        self.run_rollouts = run_rollouts
        self.finished = finished
        self.catch_up_s = catch_up_s
        self.published = 0

    async def on_work(self, work: RolloutWork, _delivery: Delivery) -> None:
        # Know which jobs ended before taking their work.
        await self.finished.wait_caught_up(self.catch_up_s)
        if work.job_id in self.finished:
            self.finished.skipped += 1  # the job ended: nobody waits for this rollout
            return
        await self._publish_all(await self.run_rollouts(work))

    async def _publish_all(self, trajectories: list[Trajectory]) -> None:
        """The item's trajectories together (one batch to the broker); one at a time if one
        is too large, so that one is replaced alone. Publishing some twice is harmless: the
        learner keeps one per sample id."""
        try:
            await self._until_published(
                partial(self.bus.publish_all, trajectories),
                f"{len(trajectories)} trajectories of group {trajectories[0].group_id}",
            )
            self.published += len(trajectories)
        except RecordTooLarge:
            for trajectory in trajectories:
                await self._publish(trajectory)

    async def _publish(self, trajectory: Trajectory) -> None:
        """One trajectory; one too large for the topic is reported and replaced by a failed
        trajectory, so the learner counts it."""
        while True:
            try:
                await self._until_published(
                    partial(self.bus.publish, trajectory), f"trajectory {trajectory.rollout_id}"
                )
                self.published += 1
                return
            except RecordTooLarge as e:
                await self.bus.publish(
                    JobEvent.of(
                        trajectory.job_id,
                        trajectory.org_id,
                        self.bus.service,
                        JobEventType.TRAJECTORY_TOO_LARGE,
                        str(e),
                        TrajectoryTooLargeData(
                            rollout_id=trajectory.rollout_id, size_bytes=e.size, limit_bytes=e.limit
                        ),
                    )
                )
                trajectory = trajectory.model_copy(
                    update={
                        "status": "failed",
                        "turns": [],
                        "reward": None,
                        "step_rewards": [],
                        "failure": RolloutFailure(kind="internal", message=str(e)),
                    }
                )

    async def _until_published(self, publish: Callable[[], Awaitable[object]], what: str) -> None:
        """Retry while the broker is away: a generator that cannot publish must not drop the
        work (the bus leaves it uncommitted if this is cancelled). A record too large is
        raised at once: sending it again cannot help."""
        delay = 0.5
        while True:
            try:
                await publish()
                return
            except RecordTooLarge:
                raise
            except Exception as e:
                log.warning("could not publish %s (%s); retrying in %.1fs", what, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
