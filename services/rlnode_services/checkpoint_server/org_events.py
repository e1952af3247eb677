"""Each job event, copied to its org's own topic (topics.org_events), where the org's users
read it with a Kafka client of theirs: the shared job-events topic holds every org's, and
Kafka's ACLs name topics, not records. Copies are signed by this service, the only one that
may write there (rlnode.bus.acls). The learner makes an org's topic before the org's first
event (`rlnode kafka-credentials` does too), so a topic missing from the last listing is
looked for again when the event is newer than that listing."""

from __future__ import annotations

import logging
import time

from rlnode.bus import Bus, Delivery
from rlnode.bus.clients import topic_names
from rlnode.messages import JobEvent, topics

log = logging.getLogger("checkpoint_server.org_events")

# Clocks of the learner's host and this one may differ by this much.
CLOCK_SKEW_S = 5.0


class OrgEventCopier:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._topics: set[str] = set()
        self._listed_at = float("-inf")  # wall-clock time of the last listing

    async def on_event(self, event: JobEvent, _delivery: Delivery) -> None:
        destination = topics.org_events(event.org_id)
        if (
            destination not in self._topics
            and event.ts.timestamp() + CLOCK_SKEW_S > self._listed_at
        ):
            await self._list()
        if destination not in self._topics:  # an org with none (its request was refused)
            return
        # Returned only once the broker has the copy: the offset is committed after it.
        await self.bus.publish(event, topic=destination)

    async def _list(self) -> None:
        listed_at = time.time()
        names = await topic_names(self.bus.settings)
        self._topics = {name for name in names if topics.is_org_events(name)}
        self._listed_at = listed_at
