"""The job's curriculum (`task_app.curriculum`): which level its rollouts are issued at, and
when that level rises. The learner is its one owner, so every generator and every Task App
replica sees the same level, and a resumed job goes on from the level its checkpoint saved;
the Task App only reads the level from its env config (a stateless app cannot lose it)."""

from __future__ import annotations

from typing import Any

from rlnode.messages import TaskAppSpec
from rlnode.messages.config import CurriculumSpec


class Curriculum:
    def __init__(self, spec: CurriculumSpec | None) -> None:
        self.spec = spec
        self.level: int | None = spec.start if spec is not None else None
        self._streak = 0  # consecutive passes of the threshold at this level

    def task_app(self, task_app: TaskAppSpec) -> TaskAppSpec:
        """The Task App spec work is issued with: the current level in its env config."""
        if self.spec is None or self.level is None:
            return task_app
        env_config = {**task_app.env_config, self.spec.key: self.level}
        return task_app.model_copy(update={"env_config": env_config})

    def observe(self, signal: str, value: float | None) -> bool:
        """A training step's reward mean (`signal` "train") or an evaluation round's pass@1
        ("eval"); True when it raised the level."""
        spec = self.spec
        if spec is None or self.level is None or signal != spec.signal or value is None:
            return False
        self._streak = self._streak + 1 if value >= spec.threshold else 0
        if self._streak < spec.patience or self.level >= spec.max_level:
            return False
        self.level += 1
        self._streak = 0
        return True

    def state(self) -> dict[str, Any]:
        return {"curriculum_level": self.level, "curriculum_streak": self._streak}

    def restore(self, state: dict[str, Any]) -> None:
        if self.spec is not None and state.get("curriculum_level") is not None:
            self.level = min(int(state["curriculum_level"]), self.spec.max_level)
            self._streak = int(state.get("curriculum_streak", 0))
