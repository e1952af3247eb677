"""Topic names, in one place. Every record on every topic is keyed by ``job_id``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from rlnode.messages.base import Stamped

JOB_REQUESTS: Final = "rlnode.job-requests"
JOB_EVENTS: Final = "rlnode.job-events"
ROLLOUT_WORK: Final = "rlnode.rollout-work"
TRAJECTORIES: Final = "rlnode.trajectories"
WEIGHT_VERSIONS: Final = "rlnode.weight-versions"
DEAD_LETTERS: Final = "rlnode.dead-letters"

ALL_TOPICS: Final[tuple[str, ...]] = (
    JOB_REQUESTS,
    JOB_EVENTS,
    ROLLOUT_WORK,
    TRAJECTORIES,
    WEIGHT_VERSIONS,
    DEAD_LETTERS,
)

# The consumer groups of docs/architecture.md §2.
LEARNER_GROUP: Final = "learner"
ROLLOUT_GENERATOR_GROUP: Final = "rollout-generator"


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
