"""The episodes a step shows as text (`rollout.sample`): which are picked, how a multi-turn
episode reads, how long texts are cut, and that the sample is bounded."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlnode.messages import JobEvent, JobEventType, TrainingSpec
from rlnode.messages.jobs import SAMPLE_TEXT_CHARS, RolloutSampleData
from rlnode.training.samples import describe, pick
from tests.factories import trajectory, turn


class Letters:
    """A tokenizer whose token k is the letter chr(k)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


def test_the_best_the_worst_and_a_failed_episode_come_first_then_the_first_others() -> None:
    step = [
        trajectory(seed=0, sample=0, reward=0.5),
        trajectory(seed=0, sample=1, reward=0.9),
        trajectory(seed=1, sample=0, reward=None),
        trajectory(seed=1, sample=1, reward=0.1),
        trajectory(seed=2, sample=0, reward=0.5),
    ]
    chosen = pick(list(reversed(step)), 4)
    assert [(x.seed, x.sample_index) for x in chosen] == [(0, 1), (1, 1), (1, 0), (0, 0)]
    assert pick(step, 0) == [] and pick([], 4) == []
    assert len(pick(step, 32)) == 5, "never more than the step has, none twice"


def test_a_multi_turn_episode_reads_as_what_each_turn_added() -> None:
    ask = [ord(c) for c in "Guess:"]
    first = turn(ask, [ord("5")])
    # The environment's answer extends the history token for token...
    second = turn(ask + [ord("5")] + [ord(c) for c in " higher."], [ord("8")])
    # ...and a turn whose prompt was rewritten shows its whole prompt.
    third = turn([ord(c) for c in "New:"], [ord("7")])
    shown = describe(trajectory(reward=1.0, turns=[first, second, third]), Letters())
    assert [(t.prompt, t.completion) for t in shown.turns] == [
        ("Guess:", "5"),
        (" higher.", "8"),
        ("New:", "7"),
    ]
    assert shown.reward == 1.0 and shown.status == "ok" and shown.failure_kind is None


def test_long_texts_keep_the_end_of_a_prompt_and_the_start_of_a_completion() -> None:
    long = [ord("a")] * SAMPLE_TEXT_CHARS + [ord("Z")]
    shown = describe(trajectory(turns=[turn(long, long)]), Letters())
    prompt, completion = shown.turns[0].prompt, shown.turns[0].completion
    assert len(prompt) == len(completion) == SAMPLE_TEXT_CHARS
    assert prompt.startswith("…") and prompt.endswith("Z")
    assert completion.startswith("a") and completion.endswith("…")


def test_a_failed_episode_says_why() -> None:
    shown = describe(trajectory(reward=None, failure="timeout"), Letters())
    assert shown.status == "failed" and shown.turns == []
    assert (shown.failure_kind, shown.failure_message) == ("timeout", "slow")


def test_the_event_checks_its_data_and_the_config_bounds_the_sample() -> None:
    samples = [describe(trajectory(reward=0.5), Letters()).model_dump()]
    event = JobEvent.of(
        "j",
        "o",
        "learner",
        JobEventType.ROLLOUT_SAMPLE,
        "step 3",
        RolloutSampleData(step=3, episodes=8, samples=samples),
    )
    assert event.typed_data() == RolloutSampleData(step=3, episodes=8, samples=samples)
    with pytest.raises(ValidationError):
        JobEvent.model_validate({**event.model_dump(by_alias=True), "data": {"step": 3}})
    assert TrainingSpec().rollout_samples == 4
    with pytest.raises(ValidationError, match="rollout_samples"):
        TrainingSpec(rollout_samples=33)
