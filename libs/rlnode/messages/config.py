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


class CurriculumSpec(StrictModel):
    """A difficulty level the learner raises as the job learns, written into every rollout's
    env config as `key` (the Task App reads it; rlnode.environments.reasoning_gym takes
    `level` to its curriculum). The level rises by one when `signal` reaches `threshold`
    `patience` times in a row: the mean reward of a training step ("train") or the pass@1 of
    an evaluation round ("eval", the held-out seeds). It never falls; `train.step` and
    `eval.completed` report it, and a resumed job goes on from its checkpoint's level."""

    key: str = Field("level", min_length=1, max_length=100)
    start: NonNegativeInt = 0
    max_level: NonNegativeInt = Field(10, le=1000)
    signal: Literal["train", "eval"] = "train"
    threshold: float = Field(0.8, description="Reward mean (train) or pass@1 (eval) to pass.")
    patience: PositiveInt = Field(
        2, le=1000, description="Consecutive steps (or rounds) at the threshold that raise it."
    )

    @model_validator(mode="after")
    def _start_within(self) -> CurriculumSpec:
        if self.start > self.max_level:
            raise ValueError(f"curriculum.start {self.start} is above max_level {self.max_level}")
        return self


class TaskAppSpec(StrictModel):
    """Which registered Task App runs the episodes, and which vault secret it checks."""

    name: ResourceId = Field(description="Name the Task App was registered under with the gateway.")
    secret: ResourceId = Field(
        "ENVIRONMENT_API_KEY", description="Name of the sealed secret in the org's vault."
    )
    env_name: str | None = None
    env_config: dict[str, Any] = Field(default_factory=dict)
    rollout_timeout_s: float = Field(300.0, gt=0, le=86_400)
    curriculum: CurriculumSpec | None = None


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


class DapoSpec(StrictModel):
    """DAPO's sampling and reward shaping (rlnode.training.losses.dapo); only with
    `algorithm = "dapo"`."""

    dynamic_sampling: bool = Field(
        True,
        description="Drop groups whose rewards are all equal and sample more prompts for the "
        "step until it has prompts_per_step groups that differ.",
    )
    max_refills: NonNegativeInt = Field(
        3, le=64, description="Extra sampling rounds a step may take to refill its groups."
    )
    overlong_buffer: NonNegativeInt = Field(
        0,
        le=131_072,
        description="Tokens before sampling.max_tokens where the soft overlong penalty starts "
        "(0: off).",
    )
    overlong_penalty: float = Field(
        1.0, ge=0.0, le=100.0, description="Reward lost by a completion that reaches max_tokens."
    )


Algorithm = Literal["grpo", "dr_grpo", "dapo", "gspo"]

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSpec(StrictModel):
    """Low-rank adapters (LoRA, via PEFT): the base model stays frozen and only the adapters
    are trained, synced to the engines (which load them as adapters) and checkpointed, with
    a reference to the base."""

    rank: PositiveInt = Field(16, le=1024)
    alpha: PositiveInt = Field(32, le=65_536, description="The update is alpha/rank x B A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        min_length=1,
        max_length=64,
        description="Names of the linear layers that get adapters (every layer's).",
    )
    modules_to_save: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]] = Field(
        default_factory=list,
        max_length=64,
        description="Modules trained in full beside the adapters and synced with them (PEFT's "
        "modules_to_save), e.g. embed_tokens: a model trained from random weights learns "
        "mostly there. A tied output layer follows its embedding.",
    )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LrScheduleSpec(StrictModel):
    """The learning rate over training steps (TRL's lr_scheduler_type with warmup_steps,
    prime-rl's scheduler): a linear warmup to `optimizer.lr`, then constant, or a linear or
    cosine decay to `min_lr_ratio` x lr by `decay_steps` (rlnode.training.schedule). Counted
    in training steps: a step's `minibatches` optimizer steps share its rate."""

    warmup_steps: NonNegativeInt = Field(
        0,
        le=10_000_000,
        description="Steps whose rate rises linearly to lr: step k (from 0) takes "
        "(k+1)/(warmup_steps+1) x lr, so the first step already learns.",
    )
    decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="What the rate does after the warmup."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Where a decay ends, as a share of lr."
    )
    decay_steps: PositiveInt | None = Field(
        None,
        le=10_000_000,
        description="The step (counted from 0, warmup included) that a decay reaches "
        "min_lr_ratio x lr at, and later steps keep; defaults to training.steps, so the last "
        "step still learns with a floor of 0.",
    )

    @model_validator(mode="after")
    def _decay_after_warmup(self) -> LrScheduleSpec:
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"training.optimizer.schedule.decay_steps ({self.decay_steps}) must be above warmup_steps "
                f"({self.warmup_steps}): the decay starts after the warmup"
            )
        return self


class AdamWSpec(StrictModel):
    """The trainer's optimizer, typed (PyTorch's AdamW, fused, decoupled weight decay; TRL's
    learning_rate, adam_beta1/2, adam_epsilon, weight_decay, max_grad_norm), with its
    learning-rate schedule: the one object the trainer takes its optimizer from."""

    name: Literal["adamw"] = Field("adamw", description="The only optimizer offered.")
    lr: float = Field(1e-5, gt=0.0, le=1.0, description="The peak learning rate.")
    betas: tuple[
        Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]
    ] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0, le=10.0)
    max_grad_norm: float = Field(
        1.0, gt=0.0, description="The global gradient norm is clipped to this before a step."
    )
    schedule: LrScheduleSpec = Field(default_factory=LrScheduleSpec)


# training.learning_rate (and its two neighbours) name the optimizer's settings, as jobs
# written before [training.optimizer] did; both at once would be two answers to one question.
_FLAT_OPTIMIZER_KEYS = {
    "learning_rate": "lr",
    "weight_decay": "weight_decay",
    "max_grad_norm": "max_grad_norm",
}


class TrainingSpec(StrictModel):
    algorithm: Algorithm = Field(
        "grpo",
        description="The policy loss (rlnode.training.losses; README, 'Training methods'): "
        "grpo, dr_grpo, dapo or gspo.",
    )
    steps: NonNegativeInt = Field(
        50,
        le=10_000_000,
        description="Optimizer steps; 0 only evaluates the model (needs an [eval] section).",
    )
    prompts_per_step: PositiveInt = Field(8, le=65_536)
    group_size: int = Field(4, ge=2, le=1024, description="Samples per prompt (GRPO needs >= 2).")
    optimizer: AdamWSpec = Field(
        default_factory=AdamWSpec,
        description="[training.optimizer]: lr, betas, eps, weight_decay, max_grad_norm and "
        "[training.optimizer.schedule]. training.learning_rate, weight_decay and max_grad_norm "
        "are read as these (jobs written before the section).",
    )
    clip_eps: float | None = Field(
        None,
        gt=0.0,
        le=10.0,
        description="PPO clip range below 1 (and above, unless clip_eps_high is set); "
        "defaults to the algorithm's: 0.2, GSPO 3e-4.",
    )
    clip_eps_high: float | None = Field(
        None,
        gt=0.0,
        le=10.0,
        description="Clip range above 1 (clip-higher); defaults to clip_eps, DAPO 0.28, GSPO 4e-4.",
    )
    kl_coef: float = Field(0.0, ge=0.0)
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Estimator of KL(policy || reference) (rlnode.training.losses.kl)."
    )
    kl_penalty: Literal["loss", "reward"] = Field(
        "loss",
        description="Where kl_coef x KL goes: a loss term, or a per-token reward penalty "
        "(each token's advantage less the penalties from it to the end).",
    )
    tis_cap: float | None = Field(
        None,
        ge=1.0,
        le=1000.0,
        description="Truncated importance sampling: weigh each token by min(trainer/sampler "
        "probability ratio, tis_cap) and clip only the ratio to the trainer's own policy "
        "before the step (None: one ratio to the sampler, clipped).",
    )
    dapo: DapoSpec | None = Field(
        None, description="DAPO's dynamic sampling and overlong penalty (algorithm = 'dapo')."
    )
    lora: LoraSpec | None = Field(
        None, description="Train low-rank adapters instead of every weight ([training.lora])."
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_optimizer_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not _FLAT_OPTIMIZER_KEYS.keys() & data.keys():
            return data
        data = dict(data)
        optimizer = data.get("optimizer", {})
        if not isinstance(optimizer, dict):
            return data  # an AdamWSpec already: a flat key beside it is refused as unknown
        optimizer = dict(optimizer)
        for flat, nested in _FLAT_OPTIMIZER_KEYS.items():
            if flat not in data:
                continue
            if nested in optimizer:
                raise ValueError(
                    f"training.{flat} and training.optimizer.{nested} are the same setting: "
                    f"keep training.optimizer.{nested} alone"
                )
            optimizer[nested] = data.pop(flat)
        data["optimizer"] = optimizer
        return data

    @model_validator(mode="after")
    def _warmup_within_steps(self) -> TrainingSpec:
        warmup = self.optimizer.schedule.warmup_steps
        if self.steps and warmup >= self.steps:
            raise ValueError(
                f"training.optimizer.schedule.warmup_steps ({warmup}) is not below "
                f"training.steps ({self.steps}): the job would end before it reached its "
                "learning rate. Shorten the warmup or train more steps"
            )
        return self

    @property
    def dapo_options(self) -> DapoSpec | None:
        """DAPO's options (their defaults when the section is left out), None for others."""
        if self.algorithm != "dapo":
            return None
        return self.dapo or DapoSpec()

    max_async: NonNegativeInt = Field(
        1, le=64, description="Policy versions rollouts may run ahead of training (0 = on-policy)."
    )
    weight_sync_every: PositiveInt = 1
    checkpoint_every: PositiveInt = 10
    tokens_per_micro_batch: PositiveInt | Literal["measured"] = Field(
        "measured",
        description="Gradient-accumulation budget: padded tokens (rows x longest row) per "
        "forward and backward pass. 'measured': sized by the trainer from its own passes (the "
        "fastest power of two whose activations fit half the memory at hand; "
        "rlnode.training.micro_batch_sizing); a number fixes it.",
    )
    logit_chunk_tokens: PositiveInt = Field(
        64,
        le=65_536,
        description="Completion tokens whose full-vocabulary logits exist at once when the "
        "trainer computes logprobs (recomputed in the backward pass): bounds that memory.",
    )
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="What the trainer's passes compute in (autocast); master weights, "
        "gradients and optimizer state stay float32. 'auto': bfloat16 on GPUs, float32 on the "
        "CPU (bfloat16 there is faster per step but not the default until a whole B9 run shows "
        "it learns as well; bench/README.md).",
    )
    weights_in_compute_dtype: bool = Field(
        False,
        description="With compute_dtype below float32 on one rank: the passes run on a "
        "copy of the weights in that dtype (rounded from the float32 masters after each "
        "optimizer step; each pass's gradients added to the masters' in float32) instead of "
        "autocast's cast of every weight at every use. On a CPU with AMX: 0.55x fp32's step, "
        "0.81x autocast's (bench/results/trainer_precision.md). Several ranks already compute "
        "on gathered bf16 copies (FSDP's mixed precision).",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each layer's activations in the backward pass: less memory "
        "for longer sequences, about a third more compute.",
    )
    share_prompts: bool = Field(
        True,
        description="Train samples with the same prompt (a group's) as one row: the prompt "
        "once, each completion attending to it and to itself only. The same logprobs and "
        "gradients for fewer tokens (rlnode.training.shared_prompts); the Tinker API's "
        "datums alike, on the prefixes they share; false: a row each.",
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
    rollout_samples: int = Field(
        4,
        ge=0,
        le=32,
        description="Episodes of each step the learner shows as text in a `rollout.sample` "
        "event (the dashboard's rollouts page): the best, the worst, a failed one and the "
        "first others; 0 shows none.",
    )
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

    def seed_of(self, index: int) -> int:
        """The Task App seed of the `index`-th training prompt."""
        return self.seeds.start + (index % self.seeds.count if self.seeds.count else index)

    def refill_seed_index(self, step: int, round_: int, prompt: int) -> int:
        """The prompt index of a DAPO refill (round 1, 2, ...): past every step's own, so a
        refill asks new questions and never one a later step asks."""
        t = self.training
        refills = t.dapo_options.max_refills if t.dapo_options else 0
        return (
            t.steps * t.prompts_per_step
            + (step * refills + round_ - 1) * t.prompts_per_step
            + prompt
        )

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
        """The seeds training visits (it wraps around a bounded `seeds` range); DAPO's
        refills take theirs after the steps' own (`refill_seed_index`)."""
        visits = self.training.steps * self.training.prompts_per_step
        dapo = self.training.dapo_options
        if dapo is not None and dapo.dynamic_sampling:
            visits *= 1 + dapo.max_refills
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
    def _curriculum_has_its_signal(self) -> JobConfig:
        curriculum = self.task_app.curriculum
        if curriculum is not None and curriculum.signal == "eval":
            if self.eval is None or self.eval.every == 0:
                raise ValueError(
                    "task_app.curriculum.signal = 'eval' rises on evaluation rounds: add an "
                    "[eval] section with every > 0, or use signal = 'train'"
                )
        return self

    @model_validator(mode="after")
    def _dapo_options(self) -> JobConfig:
        t = self.training
        if t.dapo is not None and t.algorithm != "dapo":
            raise ValueError(
                f"[training.dapo] applies to algorithm = 'dapo', not {t.algorithm!r}: set "
                "training.algorithm = 'dapo' or remove the section"
            )
        if t.dapo is not None and t.dapo.overlong_buffer >= self.sampling.max_tokens:
            raise ValueError(
                f"training.dapo.overlong_buffer ({t.dapo.overlong_buffer}) must be below "
                f"sampling.max_tokens ({self.sampling.max_tokens}): the penalty starts that "
                "many tokens before the limit"
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
