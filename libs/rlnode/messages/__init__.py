"""Every payload on every topic (DESIGN.md §2), defined once."""

from rlnode.messages.base import ID_PATTERN, Envelope, ResourceId, Stamped, StrictModel, utc_now
from rlnode.messages.config import (
    JobConfig,
    ModelSpec,
    SamplingSpec,
    SeedSpec,
    TaskAppSpec,
    TopologySpec,
    TrainingSpec,
)
from rlnode.messages.dead_letters import DeadLetter
from rlnode.messages.jobs import (
    EVENT_DATA,
    TERMINAL_EVENTS,
    EventData,
    JobAction,
    JobEvent,
    JobEventType,
    JobRequest,
)
from rlnode.messages.rollouts import RolloutFailure, RolloutWork, TokenTurn, Trajectory
from rlnode.messages.weights import ParityProbe, WeightVersion

# Every top-level payload type, by its `schema` tag.
PAYLOAD_TYPES: dict[str, type[Stamped]] = {
    m.SCHEMA: m for m in (JobRequest, JobEvent, RolloutWork, Trajectory, WeightVersion, DeadLetter)
}

__all__ = [
    "EVENT_DATA",
    "ID_PATTERN",
    "PAYLOAD_TYPES",
    "TERMINAL_EVENTS",
    "DeadLetter",
    "Envelope",
    "EventData",
    "JobAction",
    "JobConfig",
    "JobEvent",
    "JobEventType",
    "JobRequest",
    "ModelSpec",
    "ParityProbe",
    "ResourceId",
    "RolloutFailure",
    "RolloutWork",
    "SamplingSpec",
    "SeedSpec",
    "Stamped",
    "StrictModel",
    "TaskAppSpec",
    "TokenTurn",
    "TopologySpec",
    "TrainingSpec",
    "Trajectory",
    "WeightVersion",
    "utc_now",
]
