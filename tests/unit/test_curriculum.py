"""The job's curriculum: the level work is issued at, when it rises, what a checkpoint keeps,
and the job configs it refuses."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlnode.messages import TaskAppSpec
from rlnode.messages.config import CurriculumSpec
from rlnode.training.curriculum import Curriculum


def test_the_level_rises_after_patience_passes_in_a_row_and_stops_at_the_top() -> None:
    curriculum = Curriculum(CurriculumSpec(start=1, max_level=2, threshold=0.5, patience=2))
    assert curriculum.level == 1
    assert not curriculum.observe("train", 0.9)
    assert not curriculum.observe("train", 0.1)  # the streak starts again
    assert not curriculum.observe("train", 0.5)
    assert curriculum.observe("train", 0.7) and curriculum.level == 2
    assert not curriculum.observe("train", 1.0) and not curriculum.observe("train", 1.0)
    assert curriculum.level == 2


def test_only_its_own_signal_counts() -> None:
    curriculum = Curriculum(CurriculumSpec(signal="eval", threshold=0.5, patience=1))
    assert not curriculum.observe("train", 1.0) and curriculum.level == 0
    assert not curriculum.observe("eval", None)  # a round where nothing ran
    assert curriculum.observe("eval", 0.5) and curriculum.level == 1


def test_work_carries_the_level_in_its_env_config_and_the_rest_unchanged() -> None:
    task_app = TaskAppSpec(name="rg", env_config={"task": "chain_sum", "level": 9})
    curriculum = Curriculum(CurriculumSpec(key="level", start=3))
    issued = curriculum.task_app(task_app)
    assert issued.env_config == {"task": "chain_sum", "level": 3}
    assert task_app.env_config["level"] == 9  # the job's own spec is not changed
    assert Curriculum(None).task_app(task_app) is task_app


def test_a_checkpoint_keeps_the_level_and_the_streak() -> None:
    spec = CurriculumSpec(max_level=5, threshold=0.5, patience=2)
    before = Curriculum(spec)
    before.observe("train", 1.0), before.observe("train", 1.0), before.observe("train", 1.0)
    after = Curriculum(spec)
    after.restore(before.state())
    assert (after.level, after.state()) == (1, before.state())
    assert after.observe("train", 1.0) and after.level == 2  # the streak went on


def test_configs_it_refuses_say_why() -> None:
    with pytest.raises(ValidationError, match="start 4 is above max_level 3"):
        CurriculumSpec(start=4, max_level=3)
