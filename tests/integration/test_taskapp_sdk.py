"""A Task App written with the SDK, served on loopback: the contract, the key check, and an
episode against a real OpenAI-compatible endpoint."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from rlnode.taskapp import create_task_app
from rlnode.testing import ThreadedServer
from tests.integration.fakes import scripted_policy

ROOT = Path(__file__).resolve().parents[2]
KEY = "sdk-test-key-0123456789"


def _example(name: str):
    return importlib.import_module(f"rlnode.examples.taskapps.{name}")


@pytest.fixture(scope="module")
def policy():
    app, calls = scripted_policy()
    with ThreadedServer(app) as server:
        yield server.url, calls


@pytest.fixture
def copy_app(monkeypatch):
    monkeypatch.setenv("ENVIRONMENT_API_KEY", KEY)
    with ThreadedServer(create_task_app(_example("copy_task").DEFINITION)) as server:
        yield server.url


def _rollout_body(policy_url: str, seed: int = 1, **config) -> dict:
    return {
        "run_id": "run-1",
        "env": {"env_name": "copy-task", "seed": seed, "config": config},
        "policy": {"config": {"inference_url": policy_url, "model": "m", "max_tokens": 8}},
        "ops": ["agent", "env"],
        "mode": "rl",
    }


def test_the_key_is_required_on_every_route(copy_app: str, policy) -> None:
    routes = [
        ("GET", "/health"),
        ("GET", "/info"),
        ("GET", "/task_info?seeds=1"),
        ("POST", "/rollout"),
    ]
    for method, path in routes:
        for headers in ({}, {"X-API-Key": "wrong"}, {"Authorization": "Bearer wrong"}):
            response = httpx.request(
                method, copy_app + path, headers=headers, json=_rollout_body(policy[0])
            )
            assert response.status_code == 401, (method, path, headers)
            assert "API key" in response.json()["detail"]
    assert httpx.get(copy_app + "/health", headers={"X-API-Key": KEY}).json()["healthy"] is True
    assert (
        httpx.get(copy_app + "/health", headers={"Authorization": f"Bearer {KEY}"}).status_code
        == 200
    )


def test_no_configured_key_is_503(monkeypatch) -> None:
    monkeypatch.delenv("ENVIRONMENT_API_KEY", raising=False)
    with ThreadedServer(create_task_app(_example("copy_task").DEFINITION)) as server:
        response = httpx.get(server.url + "/health", headers={"X-API-Key": "anything"})
    assert response.status_code == 503 and "ENVIRONMENT_API_KEY" in response.json()["detail"]


def test_info_and_task_info(copy_app: str) -> None:
    headers = {"X-API-Key": KEY}
    info = httpx.get(copy_app + "/info", headers=headers).json()
    assert info["service"]["name"] == "copy-task" and "limits" in info and "capabilities" in info
    tasks = httpx.get(
        copy_app + "/task_info", params=[("seeds", 1), ("seeds", 2)], headers=headers
    ).json()
    assert [t["task"]["seed"] for t in tasks] == [1, 2]
    assert tasks[0]["task"]["target"] != tasks[1]["task"]["target"]
    for field in (
        "environments",
        "action_space",
        "observation",
        "dataset",
        "rubric",
        "inference",
        "capabilities",
        "limits",
    ):
        assert field in tasks[0]


def test_a_rollout_against_a_real_endpoint(copy_app: str, policy) -> None:
    response = httpx.post(
        copy_app + "/rollout",
        json=_rollout_body(policy[0], seed=5, length=6),
        headers={"X-API-Key": KEY},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["run_id"] == "run-1"
    (trajectory,) = body["trajectories"]
    (step,) = trajectory["steps"]
    assert step["reward"] == 1.0 and step["done"] is True
    assert len(step["obs"]["messages"][0]["content"].removeprefix("Copy: ")) == 6
    assert body["metrics"]["episode_returns"] == [1.0] and body["metrics"]["num_steps"] == 1
    # What the SDK serves matches the published contract.
    schema = json.loads((ROOT / "proto" / "taskapp" / "RolloutResponse.schema.json").read_text())
    jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)
    request_schema = json.loads(
        (ROOT / "proto" / "taskapp" / "RolloutRequest.schema.json").read_text()
    )
    jsonschema.validate(
        _rollout_body("http://x"), request_schema, cls=jsonschema.Draft202012Validator
    )


def test_an_inference_failure_is_a_502_that_says_so(copy_app: str) -> None:
    response = httpx.post(
        copy_app + "/rollout", json=_rollout_body("http://127.0.0.1:9"), headers={"X-API-Key": KEY}
    )
    assert response.status_code == 502 and "inference call" in response.json()["detail"]


def test_example_rewards() -> None:
    copy = _example("copy_task")
    task = {"target": "abca"}
    assert copy.reward(task, "abca") == 1.0
    assert copy.reward(task, " abca\n") == 1.0
    assert copy.reward(task, "abcb") == 0.75
    assert copy.reward(task, "abcaaaaa") == 0.5  # too long costs
    assert copy.reward(task, "") == 0.0
    assert copy.make_task(7, {}) == copy.make_task(7, {})  # deterministic per seed
    arithmetic = _example("arithmetic")
    question = arithmetic.make_task(3, {"operations": "+"})
    assert arithmetic.reward(question, f"{question['answer']}") == 1.0
    assert arithmetic.reward(question, f"The answer is {question['answer']}") == 0.8
    assert arithmetic.reward(question, f"{question['answer'] + 1}") == 0.2
    assert arithmetic.reward(question, f"It is {question['answer'] + 1}.") == 0.0
    guess = _example("guess_number").make_task(11, {"high": 10})
    assert 1 <= guess["secret"] <= 10
