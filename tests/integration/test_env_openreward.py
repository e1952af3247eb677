"""OpenReward environments (rlnode.environments.openreward) against an environment server
written with OpenReward's own SDK (tests/environments/openreward_arithmetic.py), both run as
programs with the OpenReward venv's python (openreward cannot go in the node's venv), and a
scripted policy on a real loopback HTTP endpoint that answers with OpenAI tool calls and keeps
every request it was sent. This module imports no openreward."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from fastapi import Request

from rlnode.bus.localbroker import free_port
from rlnode.testing import ThreadedServer, wait_until
from tests.integration.fakes import RecordingPolicy

ROOT = Path(__file__).resolve().parents[2]
ENV_PYTHON = ROOT / ".venvs" / "openreward" / "bin" / "python"
ENV_SERVER = ROOT / "tests" / "environments" / "openreward_arithmetic.py"
KEY = "openreward-test-key-0123456789"
# The environment server needs no network: this turns off the one call OpenReward's
# Server.run() makes outside (a version check against pypi.org, in a daemon thread).
OFFLINE = {"OPENREWARD_DISABLE_UPDATE_CHECK": "1"}

# For the lead's node test: the environment server to start, the managed Task App's command
# and a 1-2 step job's env_config (two turns: a tiny model rarely calls the tool; then 0).
ENV_SERVER_COMMAND = [str(ENV_PYTHON), str(ENV_SERVER), "--port", "{port}"]
REGISTER_COMMAND = (
    f"{ENV_PYTHON} -m rlnode.environments.openreward --server http://127.0.0.1:{{port}} "
    "--environment arithmeticenv --processes 2"
)
NODE_JOB_ENV_CONFIG = {"environment": "arithmeticenv", "max_turns": 2}


def environment_python() -> str:
    assert ENV_PYTHON.exists(), (
        f"{ENV_PYTHON} is missing: run `make environments` (OpenReward runs from a venv of its "
        "own, tools/environment-venv openreward)"
    )
    return str(ENV_PYTHON)


def started(command: list[str], env: dict[str, str], log: Path, ready) -> subprocess.Popen:
    """A program started with its output in `log`, once `ready()` is true."""
    process = subprocess.Popen(
        command, env={**os.environ, **env}, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT
    )

    def up() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"{command[1:3]} exited {process.returncode}: {log.read_text()}")
        try:
            return ready()
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, 60, f"{command[1:3]} answering", interval_s=0.2)
    except BaseException:
        process.kill()
        raise
    return process


def stopped(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()


class ScriptedSolver(RecordingPolicy):
    """An OpenAI-compatible endpoint whose `model` names how it answers "What is a + b?"."""

    async def chat(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        self.record(body)
        messages = body["messages"]
        a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", messages[0]["content"])[0])
        results = [m["content"] for m in messages if m["role"] == "tool"]
        calls: list[tuple[str, Any]] = []
        text = ""
        match body["model"]:
            case "right":
                calls = [("submit_answer", {"answer": a + b})]
            case "wrong":
                calls = [("submit_answer", {"answer": a + b + 1})]
            case "calculate-first":  # a tool that does not finish, then the one that does
                calls = (
                    [("submit_answer", {"answer": int(results[-1])})]
                    if results
                    else [("calculate", {"expression": f"{a} + {b}"})]
                )
            case "mistaken":  # an unknown tool and arguments the schema refuses, then right
                calls = (
                    [("submit_answer", {"answer": a + b})]
                    if results
                    else [
                        ("divine", {}),
                        ("submit_answer", {"answer": "many"}),
                        ("submit_answer", "{answer: 3"),
                    ]
                )
            case "ask-grader":
                calls = [("ask_grader", {"answer": a + b})]
            case _:  # plain text
                text = f"The answer is {a + b}."
        tool_calls = [
            {
                "id": f"call_{len(messages)}_{number}",
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
            for number, (name, arguments) in enumerate(calls)
        ]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return self.completion(body, message, "tool_calls" if tool_calls else "stop")


@pytest.fixture(scope="module")
def env_server(tmp_path_factory):
    python, port = environment_python(), free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("openreward") / "env-server.log"
    command = [python, str(ENV_SERVER), "--port", str(port)]
    process = started(command, OFFLINE, log, lambda: httpx.get(url + "/health").is_success)
    yield url, process
    stopped(process)


@pytest.fixture(scope="module")
def adapter(env_server, tmp_path_factory):
    python, port = environment_python(), free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("openreward") / "adapter.log"
    command = [
        python,
        "-m",
        "rlnode.environments.openreward",
        "--server",
        env_server[0],
        "--environment",
        "arithmeticenv",
        "--processes",
        "2",
    ]
    env = {**OFFLINE, "ENVIRONMENT_API_KEY": KEY, "PORT": str(port)}
    health = lambda: httpx.get(url + "/health", headers={"X-API-Key": KEY}).is_success  # noqa: E731
    process = started(command, env, log, health)
    yield url, process
    stopped(process)


@pytest.fixture(scope="module")
def policy():
    scripted = ScriptedSolver()
    with ThreadedServer(scripted.app) as server:
        scripted.url = server.url
        yield scripted


def rollout(
    adapter, policy: ScriptedSolver, seed: int, model: str, max_time_s: float = 30, **config
) -> httpx.Response:
    body = {
        "run_id": f"run-{seed}",
        "mode": config.pop("mode", "rl"),
        "env": {"seed": seed, "config": config},
        "policy": {"config": {"inference_url": policy.url, "model": model}},
        "safety": {"max_time_s": max_time_s},
    }
    policy.take()
    return httpx.post(adapter[0] + "/rollout", json=body, headers={"X-API-Key": KEY}, timeout=60)


def steps_of(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    return response.json()["trajectories"][0]["steps"]


def test_a_right_answer_earns_1_and_a_wrong_one_0(adapter, policy) -> None:
    for model, reward in (("right", 1.0), ("wrong", 0.0)):
        response = rollout(adapter, policy, 3, model)
        [step] = steps_of(response)
        assert response.json()["metrics"]["mean_return"] == reward
        assert response.json()["metrics"]["details"]["finished"] == 1.0
        assert step["reward"] == reward and step["done"]
        [call] = step["info"]["calls"]
        assert call["tool"] == "submit_answer" and call["finished"] is True
        assert call["text"] == ("Correct!" if reward else "Wrong.")
        assert call["metadata"]["expected"] > 0  # the environment's own metadata


def test_the_policy_sees_the_environments_prompt_and_tools(adapter, policy) -> None:
    steps_of(rollout(adapter, policy, 3, "right"))
    [body] = policy.take()
    [prompt] = body["messages"]
    assert prompt["role"] == "user" and prompt["content"].endswith(
        "Submit the answer with submit_answer."
    )
    tools = {t["function"]["name"]: t for t in body["tools"]}
    assert set(tools) == {"calculate", "submit_answer"}
    assert tools["submit_answer"]["type"] == "function"
    assert tools["submit_answer"]["function"]["description"].startswith("Submit the final answer")
    assert tools["submit_answer"]["function"]["parameters"] == {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
    }
    # No environment named: the server's first (arithmeticenv), as OpenReward routes it.
    steps_of(rollout(adapter, policy, 3, "right", environment=None))
    assert policy.take()[0]["messages"] == body["messages"]


def test_a_tool_that_does_not_finish_then_one_that_does(adapter, policy) -> None:
    response = rollout(adapter, policy, 5, "calculate-first")
    steps = steps_of(response)
    assert [s["reward"] for s in steps] == [0.0, 1.0]
    assert [s["done"] for s in steps] == [False, True]
    assert steps[0]["info"]["calls"][0] | {"metadata": None} == {
        "tool": "calculate",
        "arguments": {"expression": steps[0]["info"]["calls"][0]["arguments"]["expression"]},
        "text": str(steps[1]["info"]["calls"][0]["arguments"]["answer"]),
        "reward": None,
        "finished": False,
        "metadata": None,
    }
    first, second = policy.take()
    assert response.json()["metrics"]["details"]["inference_calls"] == 2
    # The second turn is the first one's messages, the reply and the tool's result.
    reply = second["messages"][1]
    assert second["messages"][:1] == first["messages"]
    assert (
        reply["role"] == "assistant" and reply["tool_calls"][0]["function"]["name"] == "calculate"
    )
    assert second["messages"][2] == {
        "role": "tool",
        "tool_call_id": reply["tool_calls"][0]["id"],
        "content": steps[0]["info"]["calls"][0]["text"],
    }


def test_the_policys_mistakes_come_back_to_it_as_tool_errors(adapter, policy) -> None:
    steps = steps_of(rollout(adapter, policy, 5, "mistaken"))
    assert [s["reward"] for s in steps] == [0.0, 1.0]
    unknown, refused, garbled = steps[0]["info"]["calls"]
    assert unknown["error"] == "error: 'divine' is not a valid tool"
    assert refused["error"].startswith("error: Tool input validation error")
    assert garbled["error"].startswith("error: the arguments of submit_answer are not a JSON")
    tool_messages = [m for m in policy.take()[1]["messages"] if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == [c["error"] for c in steps[0]["info"]["calls"]]


def test_a_plain_reply_goes_to_the_terminal_tool_or_ends_with_0(adapter, policy) -> None:
    response = rollout(adapter, policy, 2, "plain", environment="plainanswerenv")
    [step] = steps_of(response)
    assert step["reward"] == 1.0 and step["info"]["calls"][0]["tool"] == "final_answer"
    assert "tools" not in policy.take()[0]  # a terminal tool is not offered as a tool
    [step] = steps_of(rollout(adapter, policy, 2, "plain"))
    assert step["reward"] == 0.0 and step["done"] and step["info"]["ended"]


def test_max_turns_ends_an_unfinished_episode(adapter, policy) -> None:
    [step] = steps_of(rollout(adapter, policy, 5, "calculate-first", max_turns=1))
    assert step["done"] and step["reward"] == 0.0 and step["info"]["truncated"] is True


def test_eval_seeds_play_the_held_out_split(adapter, policy) -> None:
    def question(seed: int, mode: str) -> str:
        assert steps_of(rollout(adapter, policy, seed, "right", mode=mode))[0]["reward"] == 1.0
        return policy.take()[0]["messages"][0]["content"]

    training = {question(seed, "rl") for seed in range(16)}  # every training task
    held_out = {question(seed, "eval") for seed in range(1_000_000, 1_000_008)}
    assert len(training) == 16 and len(held_out) == 8 and not training & held_out
    assert all(int(n) >= 50 for q in held_out for n in re.findall(r"\d+", q))  # the test split
    assert question(7, "rl") == question(7 + 16, "rl")  # seed s: task s mod 16


def test_a_tool_that_hangs_is_stopped_by_the_rollout_timeout(adapter, policy) -> None:
    started_at = time.monotonic()
    hung = rollout(adapter, policy, 1, "ask-grader", max_time_s=2, environment="flakygraderenv")
    assert time.monotonic() - started_at < 15
    # Waiting on the server is cancellable: the episode is aborted, not its worker killed.
    assert hung.status_code == 200 and hung.json()["aborted"] is True, hung.text
    assert steps_of(rollout(adapter, policy, 1, "right"))[0]["reward"] == 1.0


def test_a_tool_that_raises_is_that_rollouts_failure(adapter, policy) -> None:
    raised = rollout(adapter, policy, 1, "right", environment="flakygraderenv")
    assert raised.status_code == 500
    detail = raised.json()["detail"]
    assert "ToolFailed: the environment's tool 'submit_answer' raised" in detail
    assert "the grader lost its answer key" in detail
    assert steps_of(rollout(adapter, policy, 1, "right"))[0]["reward"] == 1.0


def test_bad_config_is_a_clear_error(adapter, policy, env_server) -> None:
    def detail(**config) -> str:
        response = rollout(adapter, policy, 1, "right", **config)
        assert response.status_code == 500, response.text
        return response.json()["detail"]

    assert "env_config.split 'dev' is not a split" in detail(split="dev")
    assert "it has ['train', 'test']" in detail(split="dev")
    assert "env_config.eval_split is the training split 'train'" in detail(eval_split="train")
    assert "has no environment 'chessenv' (404)" in detail(environment="chessenv")
    assert "unknown fields ['spilt']" in detail(spilt="test")
    assert "env_config.max_turns must be a whole number >= 1, not 0" in detail(max_turns=0)
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{closed.getsockname()[1]}"
        assert f"server at {nowhere} (--server / env_config.server) could not be reached" in (
            detail(server=nowhere)
        )


def test_nothing_but_loopback_is_reached(adapter, env_server, policy) -> None:
    steps_of(rollout(adapter, policy, 4, "calculate-first"))
    for process in (adapter[1], env_server[1]):
        tree = psutil.Process(process.pid)
        for member in [tree, *tree.children(recursive=True)]:
            for connection in member.net_connections(kind="inet"):
                if connection.raddr:
                    assert connection.raddr.ip in ("127.0.0.1", "::1"), connection
