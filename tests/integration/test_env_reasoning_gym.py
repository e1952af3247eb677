"""reasoning-gym's tasks through rlnode.environments.reasoning_gym, served on loopback with
the library unchanged: the library's own score for a right and a wrong answer, held-out
questions apart from training ones, curriculum levels, a weighted mix, and a generator that
never returns or a scorer that raises failing only their own rollout."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from rlnode.environments import reasoning_gym as adapter
from rlnode.taskapp import Isolated, create_task_app
from rlnode.testing import ThreadedServer

KEY = "reasoning-gym-test-key-0123456789"


class Answers:
    """A policy on loopback that answers each question as the test told it to."""

    def __init__(self) -> None:
        self.replies: dict[str, str] = {}
        self.asked: list[list[dict]] = []
        self.app = FastAPI()

        @self.app.post("/v1/chat/completions")
        async def chat(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.asked.append(body["messages"])
            question = body["messages"][-1]["content"]
            text = self.replies.get(question, "I do not know")
            message = {"role": "assistant", "content": text}
            return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


@pytest.fixture(scope="module")
def policy():
    answers = Answers()
    with ThreadedServer(answers.app) as server:
        yield server.url, answers


@pytest.fixture(scope="module")
def app_url():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ENVIRONMENT_API_KEY", KEY)
        spec = Isolated(adapter.build, {"task": "chain_sum"}, processes=2)
        with ThreadedServer(create_task_app(spec)) as server:
            yield server.url


def question(seed: int, **config: Any) -> dict[str, Any]:
    """The item the adapter asks for `seed`, found with the library in this process."""
    spec = json.dumps(
        [
            adapter.task_names(config, "chain_sum"),
            config.get("config", {}),
            config.get("level"),
        ]
    )
    return adapter.item(adapter.dataset(spec), seed, adapter.HELDOUT_FROM)


def rollout(app_url: str, policy_url: str, seed: int, max_time_s: float = 60, **config: Any):
    body = {
        "run_id": f"rg-{seed}",
        "env": {"seed": seed, "config": config},
        "policy": {"config": {"inference_url": policy_url, "model": "m"}},
        "safety": {"max_time_s": max_time_s},
    }
    return httpx.post(app_url + "/rollout", json=body, headers={"X-API-Key": KEY}, timeout=90)


def test_the_librarys_score_for_a_right_and_a_wrong_answer(app_url, policy) -> None:
    url, answers = policy
    right, wrong = question(3), question(4)
    answers.replies[right["question"]] = f"Adding up. <answer>{right['answer']}</answer>"
    answers.replies[wrong["question"]] = f"<answer>{int(wrong['answer']) + 1}</answer>"
    got = rollout(app_url, url, 3).json()
    assert got["metrics"]["mean_return"] == 1.0 and got["metrics"]["details"]["correct"] == 1.0
    assert rollout(app_url, url, 4).json()["metrics"]["mean_return"] == 0.0
    # The library's prompts ask for <answer> tags: a bare right answer scores 0 by default,
    # and 1 with answer = "text".
    bare = question(5)
    answers.replies[bare["question"]] = bare["answer"]
    assert rollout(app_url, url, 5).json()["metrics"]["mean_return"] == 0.0
    assert rollout(app_url, url, 5, answer="text").json()["metrics"]["mean_return"] == 1.0


def test_held_out_seeds_ask_questions_training_never_does() -> None:
    # Level 0 of chain_sum has two one-digit terms: few enough questions that distinct
    # seeds repeat them, which is what the hash split is for.
    training = {question(s, level=0)["question"] for s in range(300)}
    held = {question(adapter.HELDOUT_FROM + s, level=0)["question"] for s in range(100)}
    assert len(training) < 300  # the space is small: seeds alone would overlap
    assert held and not training & held
    assert all(adapter.held_out(q) for q in held)


def test_the_curriculum_level_sets_the_librarys_difficulty(app_url, policy) -> None:
    url, answers = policy

    def configured(level: int) -> Any:
        spec = json.dumps([{"chain_sum": 1.0}, {}, level])
        return adapter.dataset(spec).config

    easy, hard = configured(0), configured(4)
    assert (easy.max_terms, easy.max_digits) == (2, 1)  # the library's level 0
    assert (hard.max_terms, hard.max_digits) == (6, 5)  # and its level 4
    hard = question(7, level=4)
    answers.replies[hard["question"]] = f"<answer>{hard['answer']}</answer>"
    got = rollout(app_url, url, 7, level=4).json()
    assert got["metrics"]["mean_return"] == 1.0 and got["metrics"]["details"]["level"] == 4.0


def test_a_weighted_mix_reports_each_tasks_accuracy(app_url, policy) -> None:
    url, answers = policy
    mix = {"tasks": {"gcd": 1, "count_bits": 1}}
    seen = set()
    for seed in range(12):
        entry = question(seed, **mix)
        answers.replies[entry["question"]] = f"<answer>{entry['answer']}</answer>"
        details = rollout(app_url, url, seed, **mix).json()["metrics"]["details"]
        seen.update(k for k in details if k.startswith("correct/"))
        assert details["correct"] == 1.0
    assert seen == {"correct/gcd", "correct/count_bits"}


def test_a_generator_that_never_returns_fails_only_its_rollout(app_url, policy) -> None:
    url, answers = policy
    # base_conversion draws bases until two differ: with one base it never returns.
    hang = {"task": "base_conversion", "config": {"min_base": 5, "max_base": 5}}
    response = rollout(app_url, url, 1, max_time_s=2, **hang)
    assert response.status_code == 504 and "killed and replaced" in response.json()["detail"]
    entry = question(8)
    answers.replies[entry["question"]] = f"<answer>{entry['answer']}</answer>"
    assert rollout(app_url, url, 8).json()["metrics"]["mean_return"] == 1.0


def test_a_scorer_that_raises_fails_only_its_rollout(app_url, policy) -> None:
    url, answers = policy
    factor = {"task": "prime_factorization"}
    entry = question(2, **factor)
    answers.replies[entry["question"]] = "<answer>a few primes</answer>"
    response = rollout(app_url, url, 2, **factor)
    assert response.status_code == 500
    assert "the episode raised ValueError" in response.json()["detail"]
    assert rollout(app_url, url, 8).status_code == 200


def test_bad_configs_say_what_to_change(app_url, policy) -> None:
    url, _ = policy
    unknown = rollout(app_url, url, 1, task="chain_summ").json()["detail"]
    assert "no task 'chain_summ'" in unknown and "DATASETS" in unknown
    mode = rollout(app_url, url, 1, answer="json").json()["detail"]
    assert 'use "tags" or "text"' in mode


def test_worked_examples_come_first_in_the_form_asked(app_url, policy) -> None:
    url, answers = policy
    entry = question(9)
    answers.replies[entry["question"]] = entry["answer"]
    got = rollout(app_url, url, 9, shots=2, answer="text", system_prompt="")
    assert got.json()["metrics"]["mean_return"] == 1.0
    asked = answers.asked[-1]
    assert [m["role"] for m in asked] == ["user", "assistant", "user", "assistant", "user"]
    shot = question(adapter.HELDOUT_FROM - 2)  # the training questions just below held-out
    assert asked[0]["content"] == shot["question"] and asked[1]["content"] == shot["answer"]
