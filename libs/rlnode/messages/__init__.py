"""Every payload on every topic (docs/architecture.md §2), defined once."""

from rlnode.messages.base import ID_PATTERN, Envelope, ResourceId, Stamped, StrictModel, utc_now
from rlnode.messages.config import (
    BreakerSpec,
    JobConfig,
    ModelSpec,
    SamplingSpec,
    SeedSpec,
    TaskAppSpec,
    TopologySpec,
    TrainingSpec,
)
from rlnode.messages.dead_letters import DeadLetter, DeadLetterError
from rlnode.messages.jobs import (
    ENDED_STATUSES,
    EVENT_DATA,
    JOB_ENDED,
    EventData,
    JobAction,
    JobEvent,
    JobEventType,
    JobRequest,
    ends_the_job,
)
from rlnode.messages.rollouts import (
    RolloutFailure,
    RolloutWork,
    TokenTurn,
    Trajectory,
    sample_id,
)
from rlnode.messages.tinker import TinkerCall, TinkerResult
from rlnode.messages.weights import ParityProbe, WeightVersion

# Every top-level payload type, by its `schema` tag.
PAYLOAD_TYPES: dict[str, type[Stamped]] = {
    m.SCHEMA: m
    for m in (
        JobRequest,
        JobEvent,
        RolloutWork,
        Trajectory,
        WeightVersion,
        DeadLetter,
        TinkerCall,
        TinkerResult,
    )
}

__all__ = [
    "ENDED_STATUSES",
    "EVENT_DATA",
    "ID_PATTERN",
    "JOB_ENDED",
    "PAYLOAD_TYPES",
    "BreakerSpec",
    "DeadLetter",
    "DeadLetterError",
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
    "TinkerCall",
    "TinkerResult",
    "TokenTurn",
    "TopologySpec",
    "TrainingSpec",
    "Trajectory",
    "WeightVersion",
    "ends_the_job",
    "sample_id",
    "utc_now",
]
