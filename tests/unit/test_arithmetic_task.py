"""The arithmetic Task App's questions and reward (rlnode.examples.taskapps.arithmetic)."""

from __future__ import annotations

import pytest

from rlnode.examples.taskapps import arithmetic

CONFIG = {"max_operand": 20, "operations": "+"}


def _pair(task: dict) -> str:
    return task["question"].removeprefix("What is ").split("?")[0]


def test_held_out_questions_are_never_asked_for_training_seeds() -> None:
    training = {_pair(arithmetic.make_task(s, CONFIG)) for s in range(3000)}
    heldout = {_pair(arithmetic.make_task(s, CONFIG)) for s in range(10**6, 10**6 + 300)}
    assert training.isdisjoint(heldout)
    # The split is by operand pair: about a fifth of the 441 pairs are held out.
    assert 60 <= len(heldout) <= 110
    assert all(arithmetic.make_task(10**6 + s, CONFIG)["heldout"] for s in range(20))


def test_each_seed_has_its_own_question_every_time() -> None:
    assert arithmetic.make_task(7, CONFIG) == arithmetic.make_task(7, CONFIG)
    assert len({_pair(arithmetic.make_task(s, CONFIG)) for s in range(50)}) > 30


def test_the_difficulty_knobs_shape_the_questions() -> None:
    products = arithmetic.make_task(5, {"max_operand": 9, "operations": "*"})
    a, b = (int(x) for x in _pair(products).split(" * "))
    assert products["answer"] == a * b and a <= 9 and b <= 9
    wide = [arithmetic.make_task(s, {"max_operand": 999}) for s in range(40)]
    assert max(t["answer"] for t in wide) > 1000


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("19", 1.0),
        (" 19.\n", 1.0),
        ("3 + 16 = 19", 0.8),
        ("1019", 0.2),
        ("1,019", 0.0),
        ("20", 0.2),
        ("", 0.0),
    ],
)
def test_reward_is_the_right_number_plus_the_bare_form(answer: str, expected: float) -> None:
    task = {"answer": 19}
    assert arithmetic.reward(task, answer) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("config", "message"),
    [({"max_operand": 0}, "max_operand is 0"), ({"operations": "/"}, "operations '/'")],
)
def test_bad_config_says_what_to_give(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        arithmetic.make_task(0, config)
