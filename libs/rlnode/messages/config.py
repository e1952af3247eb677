"""The job configuration a user submits inside a `JobRequest` (TOML or JSON on the CLI)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, NonNegativeInt, PositiveInt, model_validator

from rlnode.messages.base import ResourceId, StrictModel

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
ReferencePlacement = Literal["auto", "inference", "trainer", "dedicated", "none"]


class ModelSpec(StrictModel):
    """Which model to train: a Hugging Face repo id or a local directory in HF format."""

    source: Annotated[str, Field(min_length=1, max_length=1024)]
    tokenizer: str | None = Field(None, description="Defaults to `source`.")
    dtype: Dtype = "auto"
    max_seq_len: PositiveInt = Field(2048, le=1_048_576)


class TaskAppSpec(StrictModel):
    """Which registered Task App runs the episodes, and which vault secret it checks."""

    name: ResourceId = Field(description="Name the Task App was registered under with the gateway.")
    secret: ResourceId = Field(
        "ENVIRONMENT_API_KEY", description="Name of the sealed secret in the org's vault."
    )
    env_name: str | None = None
    env_config: dict[str, Any] = Field(default_factory=dict)
    rollout_timeout_s: float = Field(300.0, gt=0, le=86_400)


class SamplingSpec(StrictModel):
    max_tokens: PositiveInt = Field(64, le=131_072)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)


class SeedSpec(StrictModel):
    """Training prompts are Task App seeds: `start`, `start+1`, ... (`count` of them, or
    without end), visited in order and wrapped around."""

    start: int = 0
    count: PositiveInt | None = None


class BreakerSpec(StrictModel):
    """The Task App circuit breaker (rlnode.training.breaker): a job whose rollouts mostly
    fail pauses (`job.paused`) and probes its Task App instead of training on the few that
    survive; it resumes when the Task App answers, and fails past the time limit."""

    max_failed_share: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="A step is bad when more than this share of its rollouts failed "
        "(1.0: never, which turns the breaker off).",
    )
    consecutive_steps: PositiveInt = Field(
        2, le=1000, description="Bad steps in a row that pause the job."
    )
    give_up_after_s: float = Field(
        600.0,
        gt=0.0,
        le=7 * 86_400,
        description="How long a paused job waits for its Task App to answer the probe (and "
        "its rollouts to succeed again) before it fails.",
    )


class EvalSeeds(StrictModel):
    """Held-out Task App seeds: `start`, `start+1`, ... (`count` of them)."""

    start: int = 1_000_000
    count: PositiveInt = Field(16, le=4096)

    @property
    def range(self) -> range:
        return range(self.start, self.start + self.count)


class EvalSpec(StrictModel):
    """Evaluation while training: every `every` steps (and after the last one) the held-out
    seeds run through the Task App with `mode: "eval"` on the weights of that step, and are
    not trained on; each round ends in an `eval.completed` event, and `<job>@best` names the
    checkpoint of the best round. Off while `every` is 0 (unless the job trains no steps)."""

    every: NonNegativeInt = Field(
        0, le=10_000_000, description="Steps between evaluations (0: off)."
    )
    at_start: bool = Field(False, description="Evaluate the starting model too (step 0).")
    seeds: EvalSeeds = Field(default_factory=EvalSeeds)
    samples: PositiveInt = Field(
        1, le=1024, description="Samples per seed; above 1 the event carries pass@k."
    )
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: PositiveInt | None = Field(
        None, le=131_072, description="Defaults to sampling.max_tokens."
    )
    pass_threshold: float = Field(
        1.0, description="A sample passes when its reward is at least this (for pass@k)."
    )

    @property
    def enabled(self) -> bool:
        return self.every > 0 or self.at_start


class WandbSpec(StrictModel):
    project: str = Field("rlnode", min_length=1, max_length=128)
    run_name: str | None = Field(None, max_length=128, description="Defaults to the job id.")
    mode: Literal["offline", "online"] = Field(
        "offline", description="Only offline: the node sends no metrics off the machine."
    )

    @model_validator(mode="after")
    def _offline(self) -> WandbSpec:
        if self.mode == "online":
            raise ValueError(
                "wandb mode 'online' is not offered: the node sends no metrics off the "
                "machine. Use mode = 'offline' and `wandb sync` the run directory, or "
                "`rlnode job export JOB --to wandb` from your own machine"
            )
        return self


class LoggingSpec(StrictModel):
    """Trackers the job's events go to as they happen, written by the learner under the
    job's directory (<checkpoint store>/<org>/<job>/trackers/<name>/). For a tracking server,
    replay the job from your machine: `rlnode job export JOB --to mlflow --out URI`."""

    tensorboard: bool = Field(False, description="Event files (tensorboard --logdir DIR).")
    mlflow: bool = Field(False, description="A run in a SQLite store (mlflow.db in DIR).")
    wandb: WandbSpec | None = Field(None, description="An offline run (wandb sync DIR).")

    @property
    def trackers(self) -> list[str]:
        chosen = {"tensorboard": self.tensorboard, "mlflow": self.mlflow, "wandb": self.wandb}
        return [name for name, on in chosen.items() if on]


class TrainingSpec(StrictModel):
    algorithm: Literal["grpo"] = "grpo"
    steps: NonNegativeInt = Field(
        50,
        le=10_000_000,
        description="Optimizer steps; 0 only evaluates the model (needs an [eval] section).",
    )
    prompts_per_step: PositiveInt = Field(8, le=65_536)
    group_size: int = Field(4, ge=2, le=1024, description="Samples per prompt (GRPO needs >= 2).")
    learning_rate: float = Field(1e-5, gt=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float = Field(1.0, gt=0.0)
    clip_eps: float = Field(0.2, gt=0.0, le=10.0)
    kl_coef: float = Field(0.0, ge=0.0)
    max_async: NonNegativeInt = Field(
        1, le=64, description="Policy versions rollouts may run ahead of training (0 = on-policy)."
    )
    weight_sync_every: PositiveInt = 1
    checkpoint_every: PositiveInt = 10
    tokens_per_micro_batch: PositiveInt = Field(8192, description="Gradient-accumulation budget.")
    logit_chunk_tokens: PositiveInt = Field(
        64,
        le=65_536,
        description="Completion tokens whose full-vocabulary logits exist at once when the "
        "trainer computes logprobs (recomputed in the backward pass): bounds that memory.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each layer's activations in the backward pass: less memory "
        "for longer sequences, about a third more compute.",
    )
    minibatches: PositiveInt = Field(
        1,
        le=64,
        description=(
            "Optimizer steps per training step: the step's samples, shuffled, are dealt into "
            "this many parts with one optimizer step each (PPO-style reuse of a batch; the "
            "clipped importance ratio bounds the later steps)."
        ),
    )
    seed: int = 0
    breaker: BreakerSpec = Field(
        default_factory=BreakerSpec,
        description="When failing rollouts pause the job (the Task App circuit breaker).",
    )


class TopologySpec(StrictModel):
    """How the node's GPUs are split; see `rlnode plan`."""

    inference_gpus: NonNegativeInt | Literal["auto"] = "auto"
    training_gpus: NonNegativeInt | Literal["auto"] = "auto"
    tensor_parallel: PositiveInt = 1
    reference: ReferencePlacement = "auto"


class JobConfig(StrictModel):
    name: str | None = Field(None, max_length=200, description="A label for people.")
    model: ModelSpec
    task_app: TaskAppSpec
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    seeds: SeedSpec = Field(default_factory=SeedSpec)
    topology: TopologySpec = Field(default_factory=TopologySpec)
    eval: EvalSpec | None = Field(None, description="Held-out evaluation while training.")
    logging: LoggingSpec | None = Field(None, description="Trackers the events go to, live.")

    def eval_steps(self) -> list[int]:
        """The steps after which the model is evaluated, in order."""
        spec, steps = self.eval, self.training.steps
        if spec is None:
            return []
        due = {steps} if spec.every or steps == 0 else set()
        if spec.at_start:
            due.add(0)
        if spec.every:
            due.update(range(spec.every, steps + 1, spec.every))
        return sorted(due)

    def training_seeds(self) -> range:
        """The seeds training visits (it wraps around a bounded `seeds` range)."""
        visits = self.training.steps * self.training.prompts_per_step
        if self.seeds.count is not None:
            visits = min(visits, self.seeds.count)
        return range(self.seeds.start, self.seeds.start + visits)

    @model_validator(mode="after")
    def _eval_is_held_out(self) -> JobConfig:
        if self.training.steps == 0 and self.eval is None:
            raise ValueError(
                "training.steps = 0 trains nothing: add an [eval] section to evaluate the "
                "model, or train at least one step"
            )
        if self.eval is not None:
            seen, held = self.training_seeds(), self.eval.seeds.range
            first, last = max(seen.start, held.start), min(seen.stop, held.stop)
            if first < last:
                raise ValueError(
                    f"eval.seeds {held.start}..{held.stop - 1} overlap the seeds training "
                    f"visits ({seen.start}..{seen.stop - 1}), so they are not held out: move "
                    "eval.seeds.start past them, or bound training with seeds.count"
                )
        return self

    @model_validator(mode="after")
    def _kl_needs_reference(self) -> JobConfig:
        if self.training.kl_coef > 0 and self.topology.reference == "none":
            raise ValueError(
                "training.kl_coef > 0 needs a reference model, but topology.reference is "
                "'none': set topology.reference to 'auto' (or 'inference', 'trainer', "
                "'dedicated'), or set training.kl_coef = 0"
            )
        return self
