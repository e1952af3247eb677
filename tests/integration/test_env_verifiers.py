"""verifiers environments (rlnode.environments.verifiers), both APIs, each against the
unchanged library in its own venv (verifiers cannot go in the node's: `make environments`):
the classic API (0.3.1: tests/environments/vf_sums, a SingleTurnEnv, and vf_calculator, a
ToolEnv) and the Taskset API (0.4.0: vf_taskset_sums, a taskset, and vf_taskset_followup, a
taskset with its own multi-turn Env), loaded by their module names as published environments
are. The adapter runs as a program with that venv's
python; the policy is a scripted OpenAI endpoint on a real loopback HTTP server, answering
`stream: true` as server-sent events (as rlnode's per-rollout endpoints do). This module
imports no verifiers."""

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
from fastapi.responses import Response, StreamingResponse

from rlnode.bus.localbroker import free_port
from rlnode.testing import ThreadedServer, wait_until
from tests.integration.fakes import RecordingPolicy

ROOT = Path(__file__).resolve().parents[2]
ENVIRONMENTS = ROOT / "tests" / "environments"
KEY = "verifiers-test-key-0123456789"
VENVS = {"0.3": ROOT / ".venvs" / "verifiers-0.3", "0.4": ROOT / ".venvs" / "verifiers-0.4"}
ADAPTERS = {
    # The environments' modules on PYTHONPATH, as `pip install ./vf_sums` would put them.
    "0.3": (["vf_sums", "vf_calculator"], ["--env", "vf_sums"]),
    "0.4": (
        ["vf_taskset_sums", "vf_taskset_followup"],
        ["--env", "vf_taskset_sums", "--eval-args", '{"split": "test"}'],
    ),
}
SSE_PIECE = 3  # characters per streamed content delta
# Training and eval rows of each version's test environment (0.4's few: each of its rollouts
# starts verifiers' harness program, ~1.5 s of importing openai and mcp).
ROWS = {"0.3": (16, 8), "0.4": (4, 2)}

# For the node test: per API version, a managed Task App's command (a list), the environment
# it is registered with (`rlnode taskapp register NAME --env PYTHONPATH=... --command ...`:
# the environments' modules, as `pip install` into the venv would put them) and a short job's
# env_config (none needed: train rows for training rollouts, eval rows for an eval round).
NODE_TASK_APPS = {
    version: {
        "command": [
            str(VENVS[version] / "bin" / "python"),
            "-m",
            "rlnode.environments.verifiers",
            *options,
            "--processes",
            "2",
        ],
        "env": {"PYTHONPATH": os.pathsep.join(str(ENVIRONMENTS / m) for m in modules)},
        "env_config": {},
    }
    for version, (modules, options) in ADAPTERS.items()
}


def environment_python(version: str) -> str:
    python = VENVS[version] / "bin" / "python"
    assert python.exists(), (
        f"{python} is missing: run `make environments` (verifiers {version} runs from a venv "
        f"of its own, tools/environment-venv verifiers-{version})"
    )
    prepared = VENVS[version] / "verifiers-wheels" / "uv.toml"
    assert version == "0.3" or prepared.exists(), (
        f"{prepared} is missing: run `make environments` (it runs {python} -m "
        "rlnode.environments.verifiers --prepare: the harness program's packages, for offline)"
    )
    return str(python)


class ScriptedModel(RecordingPolicy):
    """An OpenAI-compatible endpoint whose `model` names how it answers: "right" and
    "wrong" the sums in <answer> tags, "calculator" with the calculate tool, then the
    tool's result. It answers `stream: true` as SSE chunks and keeps every request."""

    @staticmethod
    def reply(body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
        messages = body["messages"]
        question = next(m["content"] for m in messages if m["role"] == "user")
        numbers = [int(n) for n in re.findall(r"\d+", question)]
        # A follow-up ("Now add c.") adds to the sum so far.
        addends = [
            int(n)
            for m in messages[1:]
            if m["role"] == "user"
            for n in re.findall(r"add (\d+)", m["content"])
        ]
        match body["model"]:
            case "right":
                return f"<answer>{numbers[0] + numbers[1] + sum(addends)}</answer>", []
            case "wrong":
                return f"<answer>{numbers[0] + numbers[1] + 1}</answer>", []
            case "calculator" if messages[-1]["role"] == "tool":
                return f"The answer is {messages[-1]['content']}.", []
            case "calculator":
                expression = re.search(r"What is (.*)\?", question).group(1)  # type: ignore[union-attr]
                arguments = json.dumps({"expression": expression})
                call = {"name": "calculate", "arguments": arguments}
                return "", [{"id": f"call_{len(messages)}", "type": "function", "function": call}]
        raise AssertionError(f"no script for model {body['model']!r}")

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.record(body)
        text, calls = self.reply(body)
        head = {"id": "chatcmpl-1", "created": int(time.time()), "model": body["model"]}
        finish = "tool_calls" if calls else "stop"
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": 0, "message": message, "finish_reason": finish}
            return Response(
                json.dumps(head | {"object": "chat.completion", "choices": [choice]}),
                media_type="application/json",
            )
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        deltas += [{"content": text[i : i + SSE_PIECE]} for i in range(0, len(text), SSE_PIECE)]
        deltas += [{"tool_calls": [{"index": n, **call}]} for n, call in enumerate(calls)]
        chunks = [
            head | {"object": "chat.completion.chunk", "choices": [choice]}
            for choice in [{"index": 0, "delta": d, "finish_reason": None} for d in deltas]
            + [{"index": 0, "delta": {}, "finish_reason": finish}]
        ]
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
            chunks.append(head | {"object": "chat.completion.chunk", "choices": [], "usage": usage})
        events = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]
        return StreamingResponse(iter(events), media_type="text/event-stream")


@pytest.fixture(scope="module")
def model():
    scripted = ScriptedModel()
    with ThreadedServer(scripted.app) as server:
        scripted.url = server.url
        yield scripted


@pytest.fixture(scope="module", params=["0.3", "0.4"])
def adapter(request, tmp_path_factory):
    """The adapter for one API version: (version, url, process)."""
    version = request.param
    python, port = environment_python(version), free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp(f"verifiers-{version}") / "adapter.log"
    app = NODE_TASK_APPS[version]
    env = {**os.environ, **app["env"], "ENVIRONMENT_API_KEY": KEY, "PORT": str(port)}
    command = [python, *app["command"][1:]]
    process = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT
    )

    def up() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"the adapter exited {process.returncode}: {log.read_text()}")
        try:
            return httpx.get(url + "/health", headers={"X-API-Key": KEY}).is_success
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, 60, f"verifiers {version} adapter answering", interval_s=0.2)
        yield version, url, process
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


def rollout(
    adapter, model: ScriptedModel, seed: int, name: str, max_time_s: float = 60, **config
) -> httpx.Response:
    body = {
        "run_id": f"run-{seed}",
        "mode": config.pop("mode", "rl"),
        "env": {"seed": seed, "config": config},
        "policy": {"config": {"inference_url": model.url, "model": name, "max_tokens": 64}},
        "safety": {"max_time_s": max_time_s},
    }
    model.take()
    return httpx.post(adapter[1] + "/rollout", json=body, headers={"X-API-Key": KEY}, timeout=90)


def played(response: httpx.Response) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rollout's one step and its metrics."""
    assert response.status_code == 200, response.text
    [step] = response.json()["trajectories"][0]["steps"]
    return step, response.json()["metrics"]


def test_a_right_answer_earns_the_rubrics_reward_and_a_wrong_one_less(adapter, model) -> None:
    for name, correct in (("right", 1.0), ("wrong", 0.0)):
        step, metrics = played(rollout(adapter, model, 3, name))
        # correct_answer (weight 1) + the format reward (weight 0.2), as the rubric weighs them
        assert step["reward"] == pytest.approx(correct + 0.2) and step["done"]
        assert metrics["mean_return"] == pytest.approx(correct + 0.2)
        assert metrics["details"]["correct_answer"] == correct
        assert step["tool_calls"][0]["text"].startswith("<answer>")
        [body] = model.take()
        assert body["model"] == name  # the rollout's model, on its inference URL
        question = next(m["content"] for m in body["messages"] if m["role"] == "user")
        assert re.fullmatch(r"What is \d+ \+ \d+\?", question)
        assert step["obs"]["split"] == "train"


def test_the_classic_api_asks_without_streaming_and_0_4_streams(adapter, model) -> None:
    version = adapter[0]
    step, _ = played(rollout(adapter, model, 5, "right"))
    [body] = model.take()
    system = next(m["content"] for m in body["messages"] if m["role"] == "system")
    if version == "0.3":
        assert not body.get("stream")
        assert body["max_completion_tokens"] == 64  # the rollout's sampling
        assert system.startswith("Answer in this format:\n<answer>")  # the environment's own
        return
    assert body["stream"] is True and body["max_tokens"] == 64
    assert "Answer inside <answer>...</answer>." in system
    # Token for token: what verifiers assembled from the SSE pieces is the plain answer.
    plain = httpx.post(model.url + "/v1/chat/completions", json=body | {"stream": False})
    answer = plain.json()["choices"][0]["message"]["content"]
    assert len(answer) > SSE_PIECE  # so it did come in several pieces
    assert step["tool_calls"][0]["text"] == answer


def test_eval_rows_are_disjoint_from_training_rows(adapter, model) -> None:
    rows, eval_rows = ROWS[adapter[0]]
    asks = [(seed, "rl") for seed in range(rows)]  # every training row
    asks += [(seed, "eval") for seed in range(eval_rows)]  # an eval round's
    asks += [(1 + rows, "rl"), (1_000_001, "rl")]

    def question(ask: tuple[int, str]) -> str:
        seed, mode = ask
        step, _ = played(rollout(adapter, model, seed, "right", mode=mode))
        held_out = mode == "eval" or seed >= 1_000_000
        assert step["obs"]["split"] == ("eval" if held_out else "train")
        prompt = step["obs"]["prompt"]  # the row's: the classic API's messages, 0.4's text
        return prompt if isinstance(prompt, str) else prompt[-1]["content"]

    asked = {ask: question(ask) for ask in asks}
    training = {asked[seed, "rl"] for seed in range(rows)}
    held_out = {asked[seed, "eval"] for seed in range(eval_rows)}
    assert len(training) == rows and len(held_out) == eval_rows and not training & held_out
    assert all(int(n) >= 50 for q in held_out for n in re.findall(r"\d+", q))
    assert asked[1 + rows, "rl"] == asked[1, "rl"]  # seed s: row s mod N
    assert asked[1_000_001, "rl"] == asked[1, "eval"]  # held out from heldout_from on


def test_a_tool_env_plays_its_turns_and_tools(adapter, model) -> None:
    if adapter[0] != "0.3":
        pytest.skip("ToolEnv is the classic API's")
    step, metrics = played(rollout(adapter, model, 2, "calculator", env="vf_calculator"))
    assert step["reward"] == 1.0 and metrics["details"]["calculate_calls"] == 1.0
    first, second = model.take()
    [call] = first["tools"]
    assert call["function"]["name"] == "calculate"
    tool = second["messages"][-1]
    assert (
        tool["role"] == "tool"
        and step["tool_calls"][0]["text"] == f"The answer is {tool['content']}."
    )
    a, b, c = map(int, re.findall(r"\d+", second["messages"][1]["content"]))
    assert tool["content"] == str(a * b + c)  # the environment's tool ran


def test_a_multi_turn_env_plays_its_turns(adapter, model) -> None:
    if adapter[0] != "0.4":
        pytest.skip("the Taskset API's Env (the classic API's turns are the ToolEnv test's)")
    step, metrics = played(rollout(adapter, model, 1, "right", env="vf_taskset_followup"))
    assert step["reward"] == 2.0 and step["info"]["turns"] == 2
    assert metrics["details"] == metrics["details"] | {"first_answer": 1.0, "second_answer": 1.0}
    first, second = model.take()
    assert second["stream"] is True
    # The second turn is the first's conversation, its answer and the environment's follow-up.
    assert second["messages"][: len(first["messages"])] == first["messages"]
    reply, follow_up = second["messages"][len(first["messages"]) :]
    assert reply["role"] == "assistant" and reply["content"].startswith("<answer>")
    assert follow_up["role"] == "user" and re.fullmatch(r"Now add \d+\.", follow_up["content"])


def test_a_reward_function_that_raises_fails_that_rollout(adapter, model) -> None:
    classic = adapter[0] == "0.3"
    raises = {"grader": "raises"} if classic else {"task": {"grader": "raises"}}
    raised = rollout(adapter, model, 1, "right", args=raises)
    assert raised.status_code == 500, raised.text
    detail = raised.json()["detail"]
    assert "the grader lost its answer key" in detail
    # The classic API logs it and scores 0 (reported here); 0.4 records it on the trace.
    assert ("reward function correct_answer" if classic else "task SumsTask scoring") in detail
    step, _ = played(rollout(adapter, model, 1, "right"))  # the app goes on
    assert step["reward"] == pytest.approx(1.2)


def test_an_environment_that_hangs_is_stopped_by_the_rollout_timeout(adapter, model) -> None:
    version = adapter[0]
    hang = {"grader": "hangs"} if version == "0.3" else {"task": {"grader": "hangs"}}
    started = time.monotonic()
    hung = rollout(adapter, model, 1, "right", max_time_s=2, args=hang)
    assert time.monotonic() - started < 15
    if version == "0.3":  # a grader looping in plain Python: its worker is killed
        assert hung.status_code == 504, hung.text
    else:  # a grader stuck in `await`: the episode is aborted
        assert hung.status_code == 200 and hung.json()["aborted"] is True, hung.text
    step, _ = played(rollout(adapter, model, 1, "right"))
    assert step["reward"] == pytest.approx(1.2)


def test_a_policy_that_cannot_be_reached_is_the_policys_failure(adapter, model) -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{closed.getsockname()[1]}"
        body = {
            "run_id": "run-nowhere",
            "env": {"seed": 1, "config": {}},
            "policy": {"config": {"inference_url": nowhere, "model": "right"}},
            "safety": {"max_time_s": 30},
        }
        failed = httpx.post(
            adapter[1] + "/rollout", json=body, headers={"X-API-Key": KEY}, timeout=60
        )
    assert failed.status_code == 502, failed.text  # the policy's failure, not the episode's
    assert "All connection attempts failed" in failed.json()["detail"]


def test_bad_config_is_a_clear_error(adapter, model) -> None:
    def detail(mode: str = "rl", **config) -> str:
        response = rollout(adapter, model, 1, "right", mode=mode, **config)
        assert response.status_code == 500, response.text
        return response.json()["detail"]

    assert "unknown fields ['environment']" in detail(environment="x")
    assert "env_config.env 'vf_chess': no module 'vf_chess'" in detail(env="vf_chess")
    assert "env_config.args must be an object" in detail(args=[1])
    if adapter[0] == "0.3":  # the library's own messages, through its loader
        assert "unexpected keyword argument 'colour'" in detail(args={"colour": "red"})
        assert "has no eval dataset" in detail("eval", args={"num_eval": 0})
    if adapter[0] == "0.4":
        assert "held-out rollouts need env_config.eval_args" in detail("eval", eval_args=None)
        assert "split" in detail(args={"split": "dev"})  # the taskset's own validation


def test_nothing_but_loopback_is_reached(adapter, model) -> None:
    played(rollout(adapter, model, 4, "right"))
    tree = psutil.Process(adapter[2].pid)
    for member in [tree, *tree.children(recursive=True)]:
        for connection in member.net_connections(kind="inet"):
            if connection.raddr:
                assert connection.raddr.ip in ("127.0.0.1", "::1"), connection
