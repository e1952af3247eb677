"""What a job event means to a tracker: the training step it belongs to, its scalars, and a
line of text for the events that are news rather than numbers."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from rlnode.messages import JobEvent, JobEventType

# Fields that place an event, not measure it.
NOT_SCALARS = frozenset({"step", "total_steps", "world_size"})
# What an evaluation round adds up to (its per-seed table stays in the event).
EVAL_SCALARS = ("reward_mean", "reward_std", "pass_at_1", "pass_at_k", "count", "failed")
TEXT_EVENTS = frozenset(
    {
        JobEventType.ACCEPTED,
        JobEventType.STARTED,
        JobEventType.PAUSED,
        JobEventType.RESUMED,
        JobEventType.CHECKPOINT_SAVED,
        JobEventType.COMPLETED,
        JobEventType.FAILED,
        JobEventType.CANCELLED,
        JobEventType.REJECTED,
    }
)


@dataclass
class Metrics:
    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    text: str | None = None


def metrics_of(event: JobEvent, last_step: int) -> Metrics | None:
    """`train.step`: every number it carries as `train/<name>` at its step; `rollout.batch`:
    `rollouts/count`, `rollouts/failed` and the reward at the step it is trained in;
    `eval.completed`: `eval/<name>` at the step evaluated; the lifecycle events: a line of
    text at the last step seen. None for the rest."""
    data = event.data
    if event.type is JobEventType.TRAIN_STEP:
        return Metrics(data["step"], _scalars("train", data))
    if event.type is JobEventType.ROLLOUT_BATCH:
        # Its `step` counts from 0: the batch of step index s is trained as step s + 1.
        return Metrics(data["step"] + 1, _scalars("rollouts", data))
    if event.type is JobEventType.EVAL_COMPLETED:
        chosen = {name: data.get(name) for name in EVAL_SCALARS}
        return Metrics(data["step"], _scalars("eval", chosen))
    if event.type in TEXT_EVENTS:
        return Metrics(last_step, text=f"{event.type.value}: {event.message}")
    return None


def _scalars(prefix: str, data: dict) -> dict[str, float]:
    return {
        f"{prefix}/{name}": float(value)
        for name, value in data.items()
        if name not in NOT_SCALARS
        and isinstance(value, int | float)
        and not isinstance(value, bool)
    }


class EventTracker:
    """What every tracker does with an event: its scalars at their step, its text at the
    last step seen; a tracker writes them (`write_scalars`, `write_text`: by default kept as
    `lines` for the tracker to store when it closes)."""

    def __init__(self) -> None:
        self.last_step = 0
        self.lines: list[str] = []

    def log(self, event: JobEvent) -> None:
        metrics = metrics_of(event, self.last_step)
        if metrics is None:
            return
        if metrics.scalars:
            self.write_scalars(metrics.step, metrics.scalars, event.ts)
        self.last_step = max(self.last_step, metrics.step)
        if metrics.text is not None:
            self.write_text(metrics.step, metrics.text, event.ts)

    def write_scalars(self, step: int, scalars: dict[str, float], at: datetime) -> None:
        raise NotImplementedError

    def write_text(self, step: int, text: str, at: datetime) -> None:
        self.lines.append(f"{at.isoformat()} step {step} {text}")
