"""A step's episodes as people read them: the bounded sample the learner publishes in a
`rollout.sample` event (the dashboard's rollouts page reads these, never raw trajectories)."""

from __future__ import annotations

from typing import Protocol

from rlnode.messages import Trajectory
from rlnode.messages.jobs import SAMPLE_TEXT_CHARS, EpisodeSample, TurnText


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def pick(trajectories: list[Trajectory], count: int) -> list[Trajectory]:
    """At most `count` episodes that show the step: the best and the worst reward, a failed
    one, then the first others (in the order of their work: seed, then sample)."""
    ordered = sorted(trajectories, key=lambda x: (x.seed, x.sample_index, x.group_id))
    if count <= 0 or not ordered:
        return []
    ok = [x for x in ordered if x.status == "ok" and x.reward is not None]
    failed = [x for x in ordered if x.status == "failed"]
    wanted: list[Trajectory] = []
    if ok:
        wanted.append(max(ok, key=lambda x: x.reward or 0.0))
        wanted.append(min(ok, key=lambda x: x.reward or 0.0))
    if failed:
        wanted.append(failed[0])
    wanted.extend(ordered)
    chosen: list[Trajectory] = []
    for x in wanted:
        if len(chosen) == count:
            break
        if all(x.work_id != c.work_id for c in chosen):
            chosen.append(x)
    return chosen


def _tail(text: str, limit: int = SAMPLE_TEXT_CHARS) -> str:
    return text if len(text) <= limit else "…" + text[-(limit - 1) :]


def _head(text: str, limit: int = SAMPLE_TEXT_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def describe(trajectory: Trajectory, tokenizer: Decoder) -> EpisodeSample:
    """The episode as text: each turn's new prompt tokens (the whole first prompt; after that
    what the environment added, when the history was kept token for token) and completion."""
    turns = []
    history: list[int] = []
    for turn in trajectory.turns:
        extends = history and turn.prompt_ids[: len(history)] == history
        new_prompt = turn.prompt_ids[len(history) :] if extends else turn.prompt_ids
        turns.append(
            TurnText(
                prompt=_tail(tokenizer.decode(new_prompt, skip_special_tokens=False)),
                completion=_head(tokenizer.decode(turn.completion_ids, skip_special_tokens=True)),
                finish_reason=turn.finish_reason,
            )
        )
        history = turn.prompt_ids + turn.completion_ids
    failure = trajectory.failure
    return EpisodeSample(
        seed=trajectory.seed,
        sample_index=trajectory.sample_index,
        group_id=trajectory.group_id,
        status=trajectory.status,
        reward=trajectory.reward,
        failure_kind=failure.kind if failure else None,
        failure_message=_head(failure.message, 1000) if failure else None,
        turns=turns,
        duration_s=trajectory.duration_s,
    )


MAX_TASK_METRICS = 32  # an event stays small whatever a Task App reports


def task_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """The mean of each number the Task App reported (its rollouts' `metrics.details`) over
    the episodes that reported it: a mix's per-task accuracy, a curriculum's level."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for trajectory in trajectories:
        if trajectory.status != "ok":
            continue
        for name, value in trajectory.metrics.items():
            if name in sums or len(sums) < MAX_TASK_METRICS:
                sums[name] = sums.get(name, 0.0) + value
                counts[name] = counts.get(name, 0) + 1
    return {name: sums[name] / counts[name] for name in sorted(sums)}
