"""Topic names, in one place. Every record on every topic is keyed by ``job_id``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from rlnode.service import registry

if TYPE_CHECKING:
    from rlnode.messages.base import Stamped

JOB_REQUESTS: Final = "rlnode.job-requests"
JOB_EVENTS: Final = "rlnode.job-events"
ROLLOUT_WORK: Final = "rlnode.rollout-work"
TRAJECTORIES: Final = "rlnode.trajectories"
WEIGHT_VERSIONS: Final = "rlnode.weight-versions"
DEAD_LETTERS: Final = "rlnode.dead-letters"
# Tinker API runs: calls keyed by run (their per-key order is the API's per-model order),
# and their results.
TINKER_CALLS: Final = "rlnode.tinker-calls"
TINKER_RESULTS: Final = "rlnode.tinker-results"

ALL_TOPICS: Final[tuple[str, ...]] = (
    JOB_REQUESTS,
    JOB_EVENTS,
    ROLLOUT_WORK,
    TRAJECTORIES,
    WEIGHT_VERSIONS,
    DEAD_LETTERS,
    TINKER_CALLS,
    TINKER_RESULTS,
)


# An org's own topics, for its users' own Kafka clients (docs/decisions.md, "Orgs on the
# bus"): its job events, copied there by the checkpoint-server. Everything of an org's is
# named under org_prefix(org), which carries the id's length: Kafka's prefixed ACLs match
# plain string prefixes and org ids may hold dots, so "rlnode.org.a." would also be a
# prefix of org "a.b"'s names; "rlnode.org-1.a." is a prefix of org "a"'s only.
ORG_PREFIX: Final = "rlnode.org-"


def org_prefix(org_id: str) -> str:
    """What every topic and consumer group of `org_id`'s own starts with."""
    return f"{ORG_PREFIX}{len(org_id)}.{org_id}."


def org_events(org_id: str) -> str:
    """The topic `org_id`'s users read its job events from with a Kafka client of theirs."""
    return f"{org_prefix(org_id)}job-events"


def is_org_events(topic: str) -> bool:
    return topic.startswith(ORG_PREFIX) and topic.endswith(".job-events")


@dataclass(frozen=True)
class TopicRetention:
    """How long a topic keeps its records, per partition: Kafka's own retention.ms and
    retention.bytes, set when rlnode creates the topic, applied by the brokers."""

    max_age_s: float
    max_bytes: int

    def kafka_configs(self) -> dict[str, str]:
        return {
            "retention.ms": str(int(self.max_age_s * 1000)),
            "retention.bytes": str(self.max_bytes),
        }


_DAY: Final = 24 * 3600.0
_MIB: Final = 2**20
RETENTION: Final[dict[str, TopicRetention]] = {
    # Read by the learner's group; each carries a single-use token.
    JOB_REQUESTS: TopicRetention(7 * _DAY, 64 * _MIB),
    # Read from a job's first event by whoever lists or follows it (no group): a week.
    JOB_EVENTS: TopicRetention(7 * _DAY, 32 * _MIB),
    # Work queues: a group reads each record, and a restart resumes from the group's offset
    # (the learner commits trajectories and Tinker calls only once a checkpoint holds them).
    ROLLOUT_WORK: TopicRetention(_DAY, 256 * _MIB),
    TRAJECTORIES: TopicRetention(_DAY, 1024 * _MIB),
    TINKER_CALLS: TopicRetention(_DAY, 1024 * _MIB),
    # A generator that starts reads the running jobs' versions from the beginning.
    WEIGHT_VERSIONS: TopicRetention(7 * _DAY, 64 * _MIB),
    DEAD_LETTERS: TopicRetention(7 * _DAY, 256 * _MIB),
    # Read by every tinker-api from its start on (no group).
    TINKER_RESULTS: TopicRetention(_DAY, 256 * _MIB),
}


def retention_configs(topic: str) -> dict[str, str]:
    """The Kafka topic configs of `topic`'s retention; none for a topic not rlnode's."""
    retention = RETENTION.get(JOB_EVENTS if is_org_events(topic) else topic)
    return retention.kafka_configs() if retention else {}


# Who may produce what (docs/security.md). Services sign what they publish with a key the
# vault certified under their name (rlnode.bus.signing); a consumer takes a record only
# from a service named here for its topic (and, on job-events, for the event's type).
# Job requests come from users and are not signed: they carry a job token instead.
LEARNER: Final = registry.LEARNER.name
GENERATOR: Final = registry.GENERATOR.name
CHECKPOINT_SERVER: Final = registry.CHECKPOINT_SERVER.name
TINKER_API: Final = registry.TINKER_API.name
UNSIGNED_TOPICS: Final = frozenset({JOB_REQUESTS})
PRODUCERS: Final[dict[str, frozenset[str]]] = {
    ROLLOUT_WORK: frozenset({LEARNER}),
    TRAJECTORIES: frozenset({GENERATOR}),
    WEIGHT_VERSIONS: frozenset({LEARNER}),
    JOB_EVENTS: frozenset({LEARNER, GENERATOR, CHECKPOINT_SERVER}),
    DEAD_LETTERS: frozenset({LEARNER, GENERATOR, CHECKPOINT_SERVER, TINKER_API}),
    TINKER_CALLS: frozenset({TINKER_API}),
    TINKER_RESULTS: frozenset({LEARNER}),
}
# Event types a service other than the learner (which produces every type) may publish:
# what it reports itself, and job.failed when a record of the job was unusable to it.
OTHER_EVENT_PRODUCERS: Final[dict[str, frozenset[str]]] = {
    GENERATOR: frozenset(
        {"weights.loaded", "weights.refused", "trajectory.too_large", "job.failed"}
    ),
    CHECKPOINT_SERVER: frozenset({"job.failed"}),
}


# Who copies every job event to its org's own topic (and only that service writes there).
ORG_EVENTS_COPIER: Final = CHECKPOINT_SERVER


def may_produce(service: str, topic: str, payload: object) -> bool:
    """Whether `service` may have produced `payload` on `topic`."""
    if is_org_events(topic):
        return service == ORG_EVENTS_COPIER
    if service not in PRODUCERS.get(topic, frozenset()):
        return False
    if topic != JOB_EVENTS or service == LEARNER:
        return True
    kind = getattr(getattr(payload, "type", None), "value", None)
    return kind in OTHER_EVENT_PRODUCERS.get(service, frozenset())


# The consumer groups of docs/architecture.md §2.
LEARNER_GROUP: Final = "learner"
LEARNER_TRAJECTORIES_GROUP: Final = "learner-trajectories"
LEARNER_TINKER_GROUP: Final = "learner-tinker"
ROLLOUT_GENERATOR_GROUP: Final = "rollout-generator"
CHECKPOINT_SERVER_GROUP: Final = registry.CHECKPOINT_SERVER.name
# The checkpoint-server's copying of job events to the orgs' topics, apart from its index
# (its settings' org_events_group_id: the index's group and this suffix).
ORG_EVENTS_COPIER_GROUP: Final = f"{CHECKPOINT_SERVER_GROUP}.org-events"

# What each service reads, and in which consumer groups; with PRODUCERS (and who writes job
# requests), every Kafka permission a service needs: its Kafka user's ACLs are made from
# these (rlnode.bus.acls), on the node's own broker and on compose's.
READERS: Final[dict[str, frozenset[str]]] = {
    LEARNER: frozenset({JOB_REQUESTS, TRAJECTORIES, TINKER_CALLS}),
    GENERATOR: frozenset({ROLLOUT_WORK, WEIGHT_VERSIONS, JOB_EVENTS}),
    CHECKPOINT_SERVER: frozenset({JOB_EVENTS, WEIGHT_VERSIONS}),
    # Every instance reads every result (its clients' futures may be any of them), no group.
    TINKER_API: frozenset({TINKER_RESULTS}),
}
GROUPS: Final[dict[str, frozenset[str]]] = {
    LEARNER: frozenset({LEARNER_GROUP, LEARNER_TRAJECTORIES_GROUP, LEARNER_TINKER_GROUP}),
    GENERATOR: frozenset({ROLLOUT_GENERATOR_GROUP}),
    CHECKPOINT_SERVER: frozenset({CHECKPOINT_SERVER_GROUP, ORG_EVENTS_COPIER_GROUP}),
    TINKER_API: frozenset(),
}
# Job requests are written by users (the CLI, the SDK, their own clients) and by the
# checkpoint-server on behalf of the dashboard.
JOB_REQUEST_WRITERS: Final = frozenset({CHECKPOINT_SERVER})


def payload_type(topic: str) -> type[Stamped]:
    """The payload model a topic carries (docs/architecture.md §2)."""
    from rlnode import messages as m

    types: dict[str, type[Stamped]] = {
        JOB_REQUESTS: m.JobRequest,
        JOB_EVENTS: m.JobEvent,
        ROLLOUT_WORK: m.RolloutWork,
        TRAJECTORIES: m.Trajectory,
        WEIGHT_VERSIONS: m.WeightVersion,
        DEAD_LETTERS: m.DeadLetter,
        TINKER_CALLS: m.TinkerCall,
        TINKER_RESULTS: m.TinkerResult,
    }
    try:
        return types[topic]
    except KeyError:
        raise ValueError(
            f"unknown topic {topic!r}; rlnode's topics are {', '.join(ALL_TOPICS)}"
        ) from None


def topic_for(message: object) -> str:
    """The topic a payload of this type goes to."""
    for name in ALL_TOPICS:
        if isinstance(message, payload_type(name)):
            return name
    raise ValueError(f"{type(message).__name__} has no topic of its own; name the topic")
