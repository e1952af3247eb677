"""Jobs that have ended (completed, failed, cancelled), followed on the job-events topic, so
that work still queued for them is skipped rather than run: a cancelled job frees the
generators at once, and a generator that joins late does not replay dead jobs' work."""

from __future__ import annotations

import asyncio
import logging

from rlnode.bus import Bus, Delivery, Subscription
from rlnode.messages import JobEvent, topics

log = logging.getLogger("rollout_generator.finished")


class FinishedJobs:
    def __init__(self, bus: Bus) -> None:
        self.ids: set[str] = set()
        self.skipped = 0
        # Every generator reads every job's events, from the beginning: no group.
        self.subscription: Subscription[JobEvent] = bus.subscribe(
            topics.JOB_EVENTS, self.on_event, group_id=None
        )

    def __contains__(self, job_id: str) -> bool:
        return job_id in self.ids

    async def on_event(self, event: JobEvent, _delivery: Delivery) -> None:
        if event.type.ends_a_job:
            self.ids.add(event.job_id)

    async def wait_caught_up(self, timeout_s: float) -> None:
        """Until the events that existed at start are read (so old jobs are known)."""
        caught_up = self.subscription.caught_up
        if caught_up.is_set():
            return
        try:
            await asyncio.wait_for(caught_up.wait(), timeout_s)
        except TimeoutError:
            log.warning("job-events not read to the end within %.0fs; going on", timeout_s)
