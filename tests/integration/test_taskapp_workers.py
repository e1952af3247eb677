"""An isolated Task App (rlnode.taskapp.Isolated) on loopback: its episodes run in worker
processes, so one that hangs holding the GIL, raises or kills its process fails that rollout
with a message that says so, and the app goes on serving the next."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from rlnode.taskapp import Isolated, create_task_app
from rlnode.testing import ThreadedServer
from tests.integration import isolated_app
from tests.integration.fakes import scripted_policy

KEY = "isolated-test-key-0123456789"
SLEEP = {"behaviour": "sleep"}  # 3 s in the worker; says when it ran and in which process


@pytest.fixture(scope="module")
def policy():
    app, _calls = scripted_policy()
    with ThreadedServer(app) as server:
        yield server.url


@pytest.fixture(scope="module")
def app_url():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ENVIRONMENT_API_KEY", KEY)
        spec = Isolated(isolated_app.build, {"name": "isolated"}, processes=2, task_timeout_s=3)
        with ThreadedServer(create_task_app(spec)) as server:
            yield server.url


def rollout(app_url: str, policy: str, seed: int, max_time_s: float = 30, **config):
    body = {
        "run_id": f"run-{seed}",
        "env": {"seed": seed, "config": config},
        "policy": {"config": {"inference_url": policy, "model": "m"}},
        "safety": {"max_time_s": max_time_s},
    }
    return httpx.post(app_url + "/rollout", json=body, headers={"X-API-Key": KEY}, timeout=60)


def test_an_episode_runs_in_a_worker_and_scores(app_url, policy) -> None:
    response = rollout(app_url, policy, 7)
    assert response.status_code == 200, response.text
    assert response.json()["metrics"]["mean_return"] == 1.0


def test_a_hung_episode_is_killed_at_its_deadline_and_the_app_goes_on(app_url, policy) -> None:
    started = time.monotonic()
    response = rollout(app_url, policy, 1, max_time_s=1, behaviour="hang")
    assert response.status_code == 504
    assert "killed and replaced" in response.json()["detail"]
    assert time.monotonic() - started < 15
    assert rollout(app_url, policy, 2).json()["metrics"]["mean_return"] == 1.0


def test_a_task_that_never_returns_is_killed_too(app_url) -> None:
    response = httpx.get(
        app_url + "/task_info",
        params={"seeds": 1},
        headers={"X-API-Key": KEY},
        timeout=30,
    )
    assert response.status_code == 200  # the default config answers
    hung = rollout(app_url, "http://127.0.0.1:9", 3, max_time_s=1, behaviour="hang-making-task")
    assert hung.status_code == 504 and "did not finish" in hung.json()["detail"]


def test_what_an_episode_raises_is_that_rollouts_failure(app_url, policy) -> None:
    response = rollout(app_url, policy, 4, behaviour="raise")
    assert response.status_code == 500
    assert "the episode raised ValueError: cannot score 'w4'" in response.json()["detail"]
    died = rollout(app_url, policy, 5, behaviour="die")
    assert died.status_code == 500 and "exit status 3" in died.json()["detail"]
    assert rollout(app_url, policy, 6).status_code == 200


async def test_episodes_run_side_by_side_up_to_the_processes(app_url, policy) -> None:
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(seed: int, config: dict) -> dict:
            body = {
                "run_id": f"run-{seed}",
                "env": {"seed": seed, "config": config},
                "policy": {"config": {"inference_url": policy, "model": "m"}},
            }
            response = await client.post(
                app_url + "/rollout", json=body, headers={"X-API-Key": KEY}
            )
            assert response.status_code == 200, response.text
            return response.json()["trajectories"][0]["steps"][0]["info"]

        # Two at once first: a worker is spawned when none is idle (the tests before killed
        # some), and on a loaded machine a spawn took longer than a 3 s episode, so the
        # pair below ran one after the other. Now both its workers are there.
        await asyncio.gather(one(9, {}), one(10, {}))
        first, second = await asyncio.gather(one(11, SLEEP), one(12, SLEEP))
    assert first["pid"] != second["pid"]
    (start_a, end_a), (start_b, end_b) = first["ran"], second["ran"]
    assert start_a < end_b and start_b < end_a, "the two episodes ran one after the other"
