"""Jobs that have ended (completed, failed, cancelled), followed on the job-events topic, so
that work still queued for them is skipped rather than run: a cancelled job frees the
generators at once, and a generator that joins late does not replay dead jobs' work."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from rlnode.bus import Bus, Delivery, Subscription
from rlnode.messages import JobEvent, topics

log = logging.getLogger("rollout_generator.finished")


class FinishedJobs:
    def __init__(self, bus: Bus, on_end: Callable[[str], Awaitable[None]] | None = None) -> None:
        """`on_end(job_id)`: called once when a job ends (its engines are released then)."""
        self.on_end = on_end
        self.ids: set[str] = set()
        self.skipped = 0
        # Every generator reads every job's events, from the beginning: no group.
        self.subscription: Subscription[JobEvent] = bus.subscribe(
            topics.JOB_EVENTS, self.on_event, group_id=None
        )

    def __contains__(self, job_id: str) -> bool:
        return job_id in self.ids

    async def on_event(self, event: JobEvent, _delivery: Delivery) -> None:
        if event.type.ends_a_job and event.job_id not in self.ids:
            self.ids.add(event.job_id)
            if self.on_end is not None:
                await self.on_end(event.job_id)

    async def wait_caught_up(self, timeout_s: float) -> None:
        """Until the events that existed at start are read (so old jobs are known)."""
        caught_up = self.subscription.caught_up
        if caught_up.is_set():
            return
        try:
            await asyncio.wait_for(caught_up.wait(), timeout_s)
        except TimeoutError:
            log.warning("job-events not read to the end within %.0fs; going on", timeout_s)
