"""Arithmetic: one question ("What is 12 + 7? Answer with the number only."), for real
models (SmolLM2-135M-Instruct learns it in tens of steps on two CPU cores; too hard for the
tiny model).

    ENVIRONMENT_API_KEY=... PORT=8103 python -m rlnode.examples.taskapps.arithmetic

env config (the difficulty knobs): {"max_operand": 20, "operations": "+"}: operands from 0
to max_operand; each question one operation drawn from `operations` ("+", "-", "*").

Each seed's question comes from its own seeded generator, and the questions are split in
two by the operand pair: held-out pairs (one in five, chosen by a hash of the pair) are
asked only for seeds >= `heldout_from` (default 1,000,000), the rest only below it. So a job
that trains on seeds 0.. and evaluates on seeds 1,000,000.. is tested on questions it never
saw, not on a seed it never saw that happens to repeat "3 + 4".

The reward is 0.8 for the right number plus 0.2 for answering with the number alone, as the
question asks:

- right and bare ("19"): 1.0; right in a sentence ("3 + 16 = 19"): 0.8; a bare wrong number:
  0.2; anything else: 0. The right number is the last integer in the answer.
- Correctness dominates, so a right answer in words always beats a wrong one in form.
- The format part is what a small model can find by sampling long before it is reliably
  right: it turns the first steps' mostly-zero groups into a signal that shortens the
  answers, and short answers are what make a step cheap (a model that explains itself
  spends tens of tokens per sample) and leave no doubt which number is the answer.
- Eval's `pass_threshold = 0.8` counts right answers in either form (held-out accuracy).
"""

from __future__ import annotations

import hashlib
import operator
import random
import re
import sys
from typing import Any

from rlnode.taskapp import Episode, TaskAppDefinition, serve

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
INTEGER = re.compile(r"-?\d+")
BARE_NUMBER = re.compile(r"\s*-?\d+\s*\.?\s*")
CORRECT, FORMAT = 0.8, 0.2
HELDOUT_FROM = 1_000_000
HELDOUT_SHARE = 5  # one pair in five is held out


def settings(config: dict[str, Any]) -> tuple[int, str, int]:
    high = int(config.get("max_operand", 20))
    symbols = str(config.get("operations", "+"))
    heldout_from = int(config.get("heldout_from", HELDOUT_FROM))
    if not 1 <= high <= 10**6:
        raise ValueError(f"max_operand is {high}: give an integer from 1 to 1000000")
    unknown = set(symbols) - set(OPERATIONS)
    if not symbols or unknown:
        raise ValueError(f"operations {symbols!r}: give one or more of {''.join(OPERATIONS)}")
    return high, symbols, heldout_from


def held_out(a: int, b: int, symbol: str) -> bool:
    digest = hashlib.blake2b(f"{a}{symbol}{b}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") % HELDOUT_SHARE == 0


def make_task(seed: int, config: dict[str, Any]) -> dict[str, Any]:
    high, symbols, heldout_from = settings(config)
    want_heldout = seed >= heldout_from
    rng = random.Random(seed)
    while True:  # a fifth of pairs are held out: a few draws find one of the wanted half
        symbol = rng.choice(symbols)
        a, b = rng.randint(0, high), rng.randint(0, high)
        if held_out(a, b, symbol) == want_heldout:
            break
    return {
        "question": f"What is {a} {symbol} {b}? Answer with the number only.",
        "answer": OPERATIONS[symbol](a, b),
        "heldout": want_heldout,
    }


def prompt(task: dict[str, Any]) -> list[dict[str, Any]]:
    # No system message: the model's own template adds its default one.
    return [{"role": "user", "content": task["question"]}]


def grade(task: dict[str, Any], answer: str) -> tuple[bool, bool]:
    """(right, bare): the last integer is the answer; the answer is a number alone."""
    numbers = INTEGER.findall(answer.replace(",", ""))
    right = bool(numbers) and int(numbers[-1]) == task["answer"]
    return right, BARE_NUMBER.fullmatch(answer) is not None


def reward(task: dict[str, Any], answer: str) -> float:
    right, bare = grade(task, answer)
    return CORRECT * right + FORMAT * bare


async def run_episode(task: dict[str, Any], episode: Episode) -> None:
    messages = prompt(task)
    answer = await episode.chat(messages)
    right, bare = grade(task, answer.text)
    episode.step(
        {"messages": messages},
        answer.text,
        CORRECT * right + FORMAT * bare,
        done=True,
        info={"correct": right, "bare_number": bare, "finish_reason": answer.finish_reason},
    )


DEFINITION = TaskAppDefinition(
    name="arithmetic",
    description="Integer arithmetic with held-out operand pairs; 0.8 for the right number, "
    "0.2 for answering with the number alone.",
    make_task=make_task,
    run_episode=run_episode,
    dataset={
        "seeds": f"training: 0 to {HELDOUT_FROM - 1}; held-out: {HELDOUT_FROM} and up",
        "config": {"max_operand": 20, "operations": "+", "heldout_from": HELDOUT_FROM},
    },
    rubric={
        "outcome": f"{CORRECT} if the last integer in the answer is right, plus {FORMAT} if "
        "the answer is a number alone; eval pass_threshold 0.8 counts right answers",
    },
)

if __name__ == "__main__":
    sys.exit(serve(DEFINITION))
