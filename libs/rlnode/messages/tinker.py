"""Training calls of Tinker API runs (tinker-api -> learner) and their results (learner ->
tinker-api). A run is a job to the rest of the node: its records are keyed by its job id,
so Kafka's per-key order is the API's per-model order (`seq_id`), and its events,
weights and checkpoints are a job's.

The tinker-api translates the SDK's requests into these (rlnode.tinker); the learner runs
them on a `Policy` (rlnode.training.tinker). Neither side's types leak into the other."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, NonNegativeInt, model_validator

from rlnode.messages.base import Envelope, ResourceId, StrictModel
from rlnode.messages.config import LoraSpec

# Names of checkpoints and sampler weights, as the SDK's `name` arguments (path-safe).
CheckpointName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]


class TinkerDatum(StrictModel):
    """One datum: input tokens, the token scored at each position, and the loss's other
    inputs (weights, logprobs, advantages, clip thresholds), one value per position."""

    input_ids: list[int] = Field(min_length=1)
    targets: list[int]
    inputs: dict[str, list[float]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _aligned(self) -> TinkerDatum:
        n = len(self.input_ids)
        if len(self.targets) != n:
            raise ValueError(f"target_tokens has {len(self.targets)} values for {n} input tokens")
        for key, values in self.inputs.items():
            if len(values) != n:
                raise ValueError(f"{key} has {len(values)} values for {n} input tokens")
        return self


class CreateRun(StrictModel):
    op: Literal["create"] = "create"
    base_model: str = Field(min_length=1, description="The model source the run trains.")
    lora: LoraSpec | None = Field(None, description="None: every weight is trained.")
    seed: int = 0


class ForwardBackward(StrictModel):
    op: Literal["forward_backward"] = "forward_backward"
    datums: list[TinkerDatum] = Field(min_length=1)
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None = None
    forward_only: bool = False


class OptimStep(StrictModel):
    op: Literal["optim_step"] = "optim_step"
    learning_rate: float = Field(ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-12, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip_norm: float = Field(0.0, ge=0.0)


class SaveWeights(StrictModel):
    """A named checkpoint: the weights, and the optimizer's state for a later resume."""

    op: Literal["save_weights"] = "save_weights"
    name: CheckpointName


class SaveForSampler(StrictModel):
    """Weights the generators load (a weight version); `name` keeps them for good."""

    op: Literal["save_for_sampler"] = "save_for_sampler"
    name: CheckpointName | None = None


class LoadWeights(StrictModel):
    """Load a named checkpoint of a run of the same org (this one or another)."""

    op: Literal["load_weights"] = "load_weights"
    source_run: ResourceId
    name: CheckpointName
    with_optimizer: bool = False


class CloseRun(StrictModel):
    """The session that made the run ended: free its trainer (its checkpoints stay)."""

    op: Literal["close"] = "close"


TinkerOp = Annotated[
    CreateRun | ForwardBackward | OptimStep | SaveWeights | SaveForSampler | LoadWeights | CloseRun,
    Field(discriminator="op"),
]


class TinkerCall(Envelope):
    """One call of a Tinker API run (its job id), numbered in the run's order."""

    SCHEMA: ClassVar[Literal["rlnode.TinkerCall/1"]] = "rlnode.TinkerCall/1"
    schema_: Literal["rlnode.TinkerCall/1"] = Field(SCHEMA, alias="schema")

    request_id: str = Field(min_length=1, max_length=128)
    seq_id: NonNegativeInt = Field(description="The call's place in its run's order.")
    call: TinkerOp


class TinkerResult(Envelope):
    """What a call of a Tinker API run gave, or why it failed."""

    SCHEMA: ClassVar[Literal["rlnode.TinkerResult/1"]] = "rlnode.TinkerResult/1"
    schema_: Literal["rlnode.TinkerResult/1"] = Field(SCHEMA, alias="schema")

    request_id: str = Field(min_length=1, max_length=128)
    seq_id: NonNegativeInt
    op: str
    error: str | None = Field(None, description="Why the call failed; None when it worked.")
    error_category: Literal["user", "server"] | None = Field(
        None, description="user: the call was wrong (not retried); server: try again."
    )
    logprobs: list[list[float]] | None = Field(None, description="forward_backward: per datum.")
    loss_sum: float | None = None
    tokens: NonNegativeInt | None = None
    grad_norm: float | None = None
    step: NonNegativeInt | None = Field(None, description="Optimizer steps taken by the run.")
    timings: dict[str, float] = Field(
        default_factory=dict,
        description="optim_step: the learner's seconds on the step's passes (forward_backward_s, "
        "since the last step) and on the step itself (optim_step_s, its checkpoint included).",
    )
    checkpoint: str | None = Field(None, description="save_weights: the checkpoint's name.")
    weight_version: NonNegativeInt | None = Field(
        None, description="save_for_sampler: the version the generators load."
    )
    weights_uri: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def of(cls, call: TinkerCall, **fields: object) -> TinkerResult:
        """The result of `call` (its run, org, request and place), with `fields`."""
        return cls.model_validate(
            {
                "job_id": call.job_id,
                "org_id": call.org_id,
                "request_id": call.request_id,
                "seq_id": call.seq_id,
                "op": call.call.op,
                **fields,
            }
        )


# -- sampling: the tinker-api asks a generator over HTTP (no record: nothing to replay) -----


class SampleRequest(StrictModel):
    """Completions of one prompt from a run's weight version, or from the base model alone
    (`weights_uri` None)."""

    org_id: ResourceId
    job_id: ResourceId | None = Field(None, description="The run whose weights; None: the base.")
    base_model: str = Field(min_length=1, description="The model source the engine loads.")
    weights_uri: str | None = None
    weight_version: NonNegativeInt | None = None
    adapter: LoraSpec | None = None
    prompt_ids: list[int] = Field(min_length=1)
    num_samples: int = Field(1, ge=1, le=1024)
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    prompt_logprobs: bool = False


class SampledSequence(StrictModel):
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]


class SampleResult(StrictModel):
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = Field(
        None, description="Of each prompt token given those before it (None for the first)."
    )
