"""Each org's own events topic (topics.org_events), made by the learner before the org's
first job event: the checkpoint-server copies the org's events there for its users' own
Kafka clients (docs/decisions.md, "Orgs on the bus"), and finds the topic there when the
first one comes."""

from __future__ import annotations

import logging

from rlnode.bus import BusError, KafkaSettings, ensure_topics
from rlnode.messages import topics

log = logging.getLogger("learner.org_topics")


class OrgTopics:
    def __init__(self, settings: KafkaSettings) -> None:
        self.settings = settings
        self._made: set[str] = set()

    async def ensure(self, org_id: str) -> None:
        """The org's events topic exists (made with one partition if it did not). A broker
        that refuses (a cluster whose operator gave the learner no Create on the orgs'
        topics) leaves the org's events on the shared topic only: said once, not fatal."""
        if org_id in self._made:
            return
        try:
            await ensure_topics(self.settings, [topics.org_events(org_id)], partitions=1)
        except BusError as e:
            log.warning("org %s gets no events topic of its own: %s", org_id, e)
        self._made.add(org_id)
