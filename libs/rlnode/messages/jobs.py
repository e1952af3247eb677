"""Job requests (users -> learner) and job events (every service -> users)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FiniteFloat,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from rlnode.messages.base import Envelope
from rlnode.messages.config import JobConfig


class JobAction(StrEnum):
    START = "start"
    CANCEL = "cancel"


class JobRequest(Envelope):
    """Start a job (with its config) or cancel one. Carries a job token (never the org token:
    the topic is readable by its consumers): minted by the vault from the org token, good for
    this one request about this job, for minutes; the learner verifies it and refuses it a
    second time."""

    SCHEMA: ClassVar[Literal["rlnode.JobRequest/1"]] = "rlnode.JobRequest/1"
    schema_: Literal["rlnode.JobRequest/1"] = Field(SCHEMA, alias="schema")

    action: JobAction = JobAction.START
    token: str = Field(
        min_length=1,
        repr=False,
        description="A job token from the vault (POST /v1/orgs/{org}/job-tokens): single-use, "
        "for this job only, minutes long.",
    )
    config: JobConfig | None = None
    reason: str | None = Field(None, max_length=2000, description="Why (for a cancel).")

    @model_validator(mode="after")
    def _config_matches_action(self) -> JobRequest:
        if self.action is JobAction.START and self.config is None:
            raise ValueError("a 'start' request needs a config; only 'cancel' goes without one")
        if self.action is JobAction.CANCEL and self.config is not None:
            raise ValueError("a 'cancel' request takes no config")
        return self


class JobEventType(StrEnum):
    ACCEPTED = "job.accepted"
    REJECTED = "job.rejected"
    QUEUED = "job.queued"
    STARTED = "job.started"
    ROLLOUT_BATCH = "rollout.batch"
    ROLLOUT_SAMPLE = "rollout.sample"
    TRAJECTORY_TOO_LARGE = "trajectory.too_large"
    TRAIN_STEP = "train.step"
    WEIGHTS_PUBLISHED = "weights.published"
    WEIGHTS_LOADED = "weights.loaded"
    WEIGHTS_REFUSED = "weights.refused"
    CHECKPOINT_SAVED = "checkpoint.saved"
    EVAL_COMPLETED = "eval.completed"
    PAUSED = "job.paused"
    RESUMED = "job.resumed"
    COMPLETED = "job.completed"
    FAILED = "job.failed"
    CANCELLED = "job.cancelled"

    @property
    def ends_a_job(self) -> bool:
        """A verdict on a job that was accepted: it will get no more work."""
        return self in JOB_ENDED


JOB_ENDED = frozenset({JobEventType.COMPLETED, JobEventType.FAILED, JobEventType.CANCELLED})
# The job statuses these verdicts leave behind ("completed", "failed", "cancelled").
ENDED_STATUSES = frozenset(t.value.removeprefix("job.") for t in JOB_ENDED)


class EventData(BaseModel):
    """Typed payload of an event type. Producers may add fields (extra metrics) beyond
    these; the ones named here are required and checked."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class ReasonData(EventData):
    reason: str = Field(min_length=1, description="What went wrong, in words a user can act on.")


class RejectedData(ReasonData):
    action: JobAction = Field(
        JobAction.START,
        description="The request refused: a refused cancel leaves a running job running.",
    )


class EndedData(ReasonData):
    step: NonNegativeInt | None = Field(None, description="Training steps done when it ended.")


class AcceptedData(EventData):
    steps: NonNegativeInt = Field(
        description="Training steps the job will take (0: it only evaluates)."
    )
    name: str | None = Field(None, description="The job's label (config `name`).")
    model: str | None = Field(None, description="The model it trains (config model.source).")
    task_app: str | None = Field(None, description="The Task App its episodes run on.")
    algorithm: str | None = Field(None, description="The policy loss (training.algorithm).")


class CompletedData(EventData):
    steps: NonNegativeInt = Field(description="Training steps taken.")


class DeadLetteredData(ReasonData):
    """Why a record of the job was unusable (data of a `job.rejected` or `job.failed`)."""

    dead_letter_id: str
    topic: str
    partition: NonNegativeInt
    offset: NonNegativeInt


class RolloutBatchData(EventData):
    step: NonNegativeInt
    count: NonNegativeInt
    failed: NonNegativeInt
    reward_mean: FiniteFloat | None
    reward_std: FiniteFloat | None
    failures: list[str] = Field(default_factory=list, description="Failure kinds in the batch.")


SAMPLE_TEXT_CHARS = 4000  # per prompt or completion shown in a rollout sample


class TurnText(EventData):
    prompt: str = Field(
        description="What the model was asked (its end, when longer than shown): the first "
        "turn's whole prompt; a later turn's, what the environment added to the history."
    )
    completion: str
    finish_reason: str


class EpisodeSample(EventData):
    """One episode of a step as people read it."""

    seed: int
    sample_index: NonNegativeInt
    group_id: str
    status: Literal["ok", "failed"]
    reward: FiniteFloat | None
    failure_kind: str | None = None
    failure_message: str | None = None
    turns: list[TurnText] = Field(default_factory=list)
    duration_s: NonNegativeFloat = 0.0


class RolloutSampleData(EventData):
    """A bounded sample of a step's episodes as text (training.rollout_samples of them)."""

    step: NonNegativeInt = Field(description="The step the episodes were sampled for.")
    episodes: NonNegativeInt = Field(description="Episodes in the step (the sample's whole).")
    samples: list[EpisodeSample]


class TrainStepData(EventData):
    step: PositiveInt
    total_steps: PositiveInt
    loss: FiniteFloat
    reward_mean: FiniteFloat
    reward_std: FiniteFloat
    kl: FiniteFloat | None
    clip_fraction: FiniteFloat
    staleness_min: NonNegativeInt
    staleness_mean: NonNegativeFloat
    staleness_max: NonNegativeInt
    tokens_per_s: NonNegativeFloat
    wait_s: NonNegativeFloat
    compute_s: NonNegativeFloat
    generation_s: NonNegativeFloat = Field(
        0.0,
        description="The longest rollout of the step: its samples run together, so about the "
        "wall time of the step's generation (and Task App calls).",
    )
    trained_samples: NonNegativeInt = 0
    micro_batch_tokens: PositiveInt | None = Field(
        None,
        description="The token budget the step's micro-batches were packed to (sized from the "
        "trainer's measurements unless the job fixes tokens_per_micro_batch); None when the "
        "step trained nothing.",
    )
    world_size: PositiveInt = 1
    failed_rollouts: NonNegativeInt = 0
    merged_trajectories: NonNegativeInt = Field(
        0,
        description="Multi-turn trajectories trained as one sequence: each turn's prompt "
        "started with the previous turn's prompt and completion, token for token.",
    )
    per_turn_trajectories: NonNegativeInt = Field(
        0,
        description="Multi-turn trajectories trained as one sample per turn: a turn's prompt "
        "did not extend the previous turn's (the history was truncated, rewritten or "
        "tokenised differently).",
    )
    mismatch_kl: NonNegativeFloat | None = Field(
        None,
        description="KL(sampler || trainer) of the trained tokens before the step's update "
        "(k3 estimate): the engines' numerical gap plus the samples' staleness. A rise warns "
        "of a run about to collapse; training.tis_cap corrects for it.",
    )
    learning_rate: NonNegativeFloat | None = Field(
        None, description="The step's learning rate (training.optimizer.schedule)."
    )
    grad_norm: NonNegativeFloat | None = Field(
        None,
        description="The gradient norm before clipping (the mean over the step's optimizer "
        "steps); None when the step trained nothing.",
    )
    curriculum_level: NonNegativeInt | None = Field(
        None,
        description="The curriculum's level after this step (task_app.curriculum; None "
        "without one): the level the next work is issued at.",
    )
    task_metrics: dict[str, FiniteFloat] = Field(
        default_factory=dict,
        description="The mean of each number the Task App reported in its rollouts' "
        "metrics.details, over the step's episodes that reported it.",
    )


class WeightsPublishedData(EventData):
    version: NonNegativeInt
    step: NonNegativeInt
    uri: str
    blake3: str
    size_bytes: NonNegativeInt = 0
    write_s: NonNegativeFloat = Field(
        0.0, description="Writing and hashing the file and scoring the parity probe."
    )


class WeightsLoadedData(EventData):
    version: NonNegativeInt
    generator: str
    load_s: NonNegativeFloat
    probe_max_abs_diff: NonNegativeFloat
    probe_ok: bool
    transport: Literal["shared-memory", "http"] = Field(
        "shared-memory",
        description="How the file reached the generator: shared-memory, read where the learner "
        "wrote it (the node's weights store, or beside the checkpoints when that had no room); "
        "http, downloaded from the learner (GENERATOR_WEIGHTS_URL) by a generator that could "
        "not see it.",
    )
    fetch_s: NonNegativeFloat = Field(0.0, description="The download, for transport http.")
    fetch_resumes: NonNegativeInt = Field(
        0, description="Broken downloads resumed (Range) before the file was whole."
    )
    fetch_reused: bool = Field(
        False,
        description="For transport http: the host had the version already (another generator "
        "of the host downloaded it; one download per host), so fetch_s was the wait for it.",
    )
    paused_s: NonNegativeFloat = Field(
        0.0,
        description="How long generation was held back for it: vLLM's pause to its resume "
        "(with GENERATOR_VLLM_SWAP=wait, the drain of the requests in flight included; with "
        "keep, the reload alone); the torch engine reports its whole load.",
    )


class WeightsRefusedData(EventData):
    version: NonNegativeInt
    generator: str
    reason: str = Field(min_length=1)


class CheckpointSavedData(EventData):
    step: NonNegativeInt
    uri: str
    final: bool = False


class SeedEval(EventData):
    seed: int
    samples: NonNegativeInt = Field(description="Samples that ran (failed ones excluded).")
    failed: NonNegativeInt
    reward_mean: FiniteFloat | None
    passed: NonNegativeInt = Field(description="Samples whose reward reached the threshold.")


class EvalCompletedData(EventData):
    """One evaluation round: the held-out seeds on the weights of `step`, not trained on."""

    step: NonNegativeInt = Field(description="Training steps behind the weights evaluated.")
    version: NonNegativeInt = Field(description="The weight version the rollouts sampled from.")
    seeds: PositiveInt
    samples_per_seed: PositiveInt
    count: NonNegativeInt = Field(description="Rollouts that ran.")
    failed: NonNegativeInt
    reward_mean: FiniteFloat | None = Field(description="Over the rollouts that ran.")
    reward_std: FiniteFloat | None
    pass_at_1: FiniteFloat | None = Field(
        description="Expected share of seeds a single sample passes (reward >= threshold)."
    )
    pass_at_k: FiniteFloat | None = Field(
        None, description="Share of seeds with a passing sample among k (k = samples > 1)."
    )
    k: PositiveInt
    pass_threshold: FiniteFloat
    temperature: NonNegativeFloat
    duration_s: NonNegativeFloat
    per_seed: list[SeedEval] = Field(default_factory=list)
    curriculum_level: NonNegativeInt | None = Field(
        None, description="The curriculum's level the round ran at (None without one)."
    )
    task_metrics: dict[str, FiniteFloat] = Field(
        default_factory=dict,
        description="The mean of each number the Task App reported, over the round's episodes.",
    )


class PausedData(EventData):
    """The Task App circuit breaker tripped (training.breaker): the job trains no further
    step and issues no new work until its Task App answers the probe."""

    step: NonNegativeInt = Field(
        description="Training steps done; the last of them tripped the breaker (and counts)."
    )
    bad_steps: PositiveInt = Field(
        description="Steps in a row whose failed share passed max_failed_share."
    )
    rollouts: PositiveInt = Field(description="Rollouts of those steps.")
    failed: NonNegativeInt = Field(description="Failed rollouts of those steps.")
    failures: dict[str, NonNegativeInt] = Field(
        description="Failure kinds of those rollouts, and how many of each."
    )
    max_failed_share: float = Field(gt=0.0, le=1.0, description="The threshold it passed.")
    after_resume: bool = Field(
        False,
        description="Tripped by the first step after a resume: the Task App answered its "
        "probe, but its rollouts still fail.",
    )
    give_up_after_s: PositiveFloat = Field(
        description="How long the job waits for the Task App, from the first pause, before "
        "it fails."
    )


class ResumedData(EventData):
    step: NonNegativeInt = Field(description="Training steps done; training goes on from here.")
    paused_s: NonNegativeFloat = Field(description="How long the job was paused.")
    probes: PositiveInt = Field(description="Probes of the Task App while paused.")
    probe: str = Field(description="What the last probe said.")


class TrajectoryTooLargeData(EventData):
    rollout_id: str
    size_bytes: PositiveInt
    limit_bytes: PositiveInt


EVENT_DATA: dict[JobEventType, type[EventData]] = {
    JobEventType.ACCEPTED: AcceptedData,
    JobEventType.REJECTED: RejectedData,
    JobEventType.FAILED: EndedData,
    JobEventType.CANCELLED: EndedData,
    JobEventType.COMPLETED: CompletedData,
    JobEventType.ROLLOUT_BATCH: RolloutBatchData,
    JobEventType.ROLLOUT_SAMPLE: RolloutSampleData,
    JobEventType.TRAJECTORY_TOO_LARGE: TrajectoryTooLargeData,
    JobEventType.TRAIN_STEP: TrainStepData,
    JobEventType.WEIGHTS_PUBLISHED: WeightsPublishedData,
    JobEventType.WEIGHTS_LOADED: WeightsLoadedData,
    JobEventType.WEIGHTS_REFUSED: WeightsRefusedData,
    JobEventType.CHECKPOINT_SAVED: CheckpointSavedData,
    JobEventType.EVAL_COMPLETED: EvalCompletedData,
    JobEventType.PAUSED: PausedData,
    JobEventType.RESUMED: ResumedData,
}


class JobEvent(Envelope):
    """Something that happened to a job. `data` is checked against the event type's model
    (see EVENT_DATA) where one is defined."""

    SCHEMA: ClassVar[Literal["rlnode.JobEvent/1"]] = "rlnode.JobEvent/1"
    schema_: Literal["rlnode.JobEvent/1"] = Field(SCHEMA, alias="schema")

    type: JobEventType
    source: str = Field(min_length=1, max_length=200, description="The service that emitted it.")
    message: str = Field("", max_length=10_000, description="One line for people.")
    data: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _data_matches_type(self) -> JobEvent:
        model = EVENT_DATA.get(self.type)
        if model is not None:
            self.data = model.model_validate(self.data).model_dump(mode="json")
        return self

    def typed_data(self) -> EventData:
        return EVENT_DATA.get(self.type, EventData).model_validate(self.data)

    @classmethod
    def of(
        cls,
        job_id: str,
        org_id: str,
        source: str,
        kind: JobEventType,
        message: str = "",
        data: EventData | None = None,
    ) -> JobEvent:
        """An event built from its typed data (the model EVENT_DATA names for `kind`)."""
        return cls(
            job_id=job_id,
            org_id=org_id,
            type=kind,
            source=source,
            message=message,
            data=data.model_dump(mode="json") if data is not None else {},
        )


def ends_the_job(event: JobEvent, accepted: bool) -> bool:
    """Whether this event is the job's last word: a verdict after acceptance, or a
    rejection of the start request before it (a refused cancel leaves the job running)."""
    if event.type.ends_a_job:
        return True
    return (
        event.type is JobEventType.REJECTED
        and not accepted
        and event.data.get("action", JobAction.START) == JobAction.START
    )
