"""A verifiers environment in the classic (0.3) API, written as the Environments Hub publishes
them (a module with `load_environment(**kwargs)`), for rlnode's verifiers adapter tests
(tests/integration/test_env_verifiers.py). Run it with the verifiers-0.3 venv's python
(`make environments`); it imports nothing of rlnode's.

A SingleTurnEnv: "What is a + b?", answered inside <answer>...</answer> (an XMLParser). Its
Rubric: `correct_answer` (weight 1) and the parser's format reward (weight 0.2). The training
dataset has operands 10..49, the eval dataset 50..99, so no eval question is a training one.
`grader` picks a broken grader for the tests: "raises" (the reward function raises),
"hangs" (it never returns).
"""

from __future__ import annotations

import random
import time

import verifiers as vf
from datasets import Dataset


def questions(low: int, high: int, count: int, seed: int) -> Dataset:
    operands = range(low, high + 1)
    pairs = random.Random(seed).sample([(a, b) for a in operands for b in operands], count)
    return Dataset.from_list(
        [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in pairs]
    )


def load_environment(grader: str = "exact", num_train: int = 16, num_eval: int = 8):
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def correct_answer(completion, answer, **kwargs) -> float:
        if grader == "raises":
            raise RuntimeError("the grader lost its answer key")
        if grader == "hangs":
            while True:  # a grader stuck in a loop, holding the event loop
                time.sleep(1)
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    rubric = vf.Rubric(
        funcs=[correct_answer, parser.get_format_reward_func()],
        weights=[1.0, 0.2],
        parser=parser,
    )
    return vf.SingleTurnEnv(
        dataset=questions(10, 49, num_train, seed=1),
        eval_dataset=questions(50, 99, num_eval, seed=2),
        system_prompt=f"Answer in this format:\n{parser.get_format_str()}",
        parser=parser,
        rubric=rubric,
    )
