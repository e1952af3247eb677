"""Synth's container contract (synth-containers==0.4.6) through a real gateway: a Task App
written with synth-containers' own SDK (tests/environments/synth_sums.py), run from the
library's venv as a managed Task App (sandboxed, key injected), verified, and rolled out
against a scripted policy on loopback: the right answer's reward and a wrong one's, eval
rollouts on its held-out split, a scorer that raises and a rollout that hangs failing only
their own rollout. And drift: our request bodies validated by synth-containers' own request
model, and its own result record read back by our translation, in its venv (this venv
cannot import it: vLLM pins fastapi<0.137, synth-containers needs >=0.141.1)."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from rlnode.bus.localbroker import free_port
from rlnode.node.processes import ServiceProcess
from rlnode.sdk.gateway import GatewayClient
from rlnode.service.registry import SERVICES_BY_NAME
from rlnode.taskapp import RolloutRequest, containers
from rlnode.testing import ThreadedServer
from tests.integration.vault_fixtures import RunningVault

ROOT = Path(__file__).resolve().parents[2]
SYNTH_PYTHON = ROOT / ".venvs" / "synth-containers" / "bin" / "python"
APP = ROOT / "tests" / "environments" / "synth_sums.py"


def synth_python() -> str:
    if not SYNTH_PYTHON.exists():
        pytest.fail(
            f"{SYNTH_PYTHON} is missing: run `make environments` "
            "(tools/environment-venv synth-containers builds it)"
        )
    return str(SYNTH_PYTHON)


def scripted_policy() -> FastAPI:
    """Answers "What is a + b?" right when asked as model "right", one off as "wrong"."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        a, b = map(int, re.findall(r"\d+", body["messages"][-1]["content"]))
        answer = a + b if body["model"] == "right" else a + b + 1
        message = {"role": "assistant", "content": str(answer)}
        return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}

    return app


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A vault, the gateway, the policy, and the SDK's Task App registered managed."""
    python = synth_python()
    directory = tmp_path_factory.mktemp("synth-containers")
    vault = RunningVault(f"sqlite:///{directory / 'vault.sqlite3'}", directory / "vault").start()
    org, token = vault.new_org()
    with vault.client(token) as client:
        client.set_secret("ENVIRONMENT_API_KEY", "tk-" + secrets.token_hex(16))
    env = {
        "GATEWAY_VAULT_URL": vault.url,
        "GATEWAY_SERVICE_TOKEN": vault.service_token(["secrets:unseal"]),
        "DATABASE_URL": f"sqlite:///{directory / 'gateway.sqlite3'}",
        "RLNODE_DATA_DIR": str(directory / "gateway-data"),
        "GATEWAY_ALLOW_URLS_TO": '["loopback"]',  # the external registration below
    }
    process = ServiceProcess(
        SERVICES_BY_NAME["taskapp-gateway"], free_port(), directory / "gateway.log", env
    ).start()
    try:
        with ThreadedServer(scripted_policy()) as policy:
            process.wait_healthy()
            with GatewayClient(process.url, token) as client:
                client.register("sums", command=[python, str(APP)])
            runner = vault.service_token(["rollouts:run"], service="rollout-generator")
            yield process, org, token, runner, policy.url
    finally:
        stopped = process.stop()
        vault.stop()
        assert stopped == 0, process.log_tail()


def rollout(
    gateway, seed: int, model: str = "right", mode: str = "rl", task_app: str = "sums", **options
) -> dict:
    process, org, _token, runner, policy_url = gateway
    request = {
        "run_id": f"run-{uuid.uuid4().hex[:10]}",
        "env": {"seed": seed, "config": options.pop("config", {})},
        "policy": {"config": {"inference_url": policy_url, "model": model, "max_tokens": 8}},
        "mode": mode,
    }
    with GatewayClient(process.url, runner) as client:
        return client.rollout(org, task_app, request, job_id="job-1", **options)


def summary(outcome: dict) -> dict:
    return outcome["response"]["trajectories"][0]["steps"][-1]["info"]["summary"]


def test_verify_passes_and_reports_the_container_contract(gateway) -> None:
    process, _org, token, _runner, _policy = gateway
    with GatewayClient(process.url, token) as client:
        report = client.verify("sums")
    assert report["ok"], report
    assert report["contract"] == containers.CONTAINER_CONTRACT
    assert "the version tested (synth-containers==0.4.6)" in report["accepts_key"]["detail"]
    assert "takes no key" in report["refuses_wrong_key"]["detail"]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("RLNODE_")}
    environment |= {"RLNODE_GATEWAY_URL": process.url, "RLNODE_TOKEN": token}
    cli = subprocess.run(
        [sys.executable, "-m", "rlnode.cli", "taskapp", "verify", "sums"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 0 and "verified: a job can use it" in cli.stdout, cli


def test_an_external_container_runs_rollouts_but_fails_verify_for_want_of_a_key(
    gateway,
) -> None:
    """Registered by URL, anyone who reaches it can run its rollouts: verify says so."""
    process, _org, token, _runner, _policy = gateway
    with GatewayClient(process.url, token) as client:
        port = client.get("sums")["managed"]["port"]
        client.register("sums-outside", url=f"http://127.0.0.1:{port}")
        report = client.verify("sums-outside")
    assert report["healthy"]["ok"] and report["accepts_key"]["ok"], report
    assert not report["ok"] and report["contract"] == containers.CONTAINER_CONTRACT
    assert "it must refuse" in report["refuses_wrong_key"]["detail"]
    assert "register it managed" in report["refuses_wrong_key"]["detail"]
    # The same sandboxed process: the managed registration's rollout opens it the policy.
    assert rollout(gateway, seed=0)["status"] == "ok"
    assert rollout(gateway, seed=0, task_app="sums-outside")["result"]["reward"] == 1.0


def test_a_right_answer_scores_above_a_wrong_one(gateway) -> None:
    right, wrong = rollout(gateway, seed=1), rollout(gateway, seed=1, model="wrong")
    assert right["status"] == wrong["status"] == "ok", (right, wrong)
    assert right["result"]["reward"] == 1.0 and wrong["result"]["reward"] == 0.0
    assert right["result"]["metrics"]["correct"] == 1.0
    assert summary(right) == {"split": "train", "question": "What is 17 + 25?", "said": "42"}
    assert summary(wrong)["said"] == "43"


def test_eval_rollouts_take_the_held_out_split(gateway) -> None:
    """rlnode's eval seeds (1,000,000 on) go to the container's held-out split, the rows of
    its /dataset/rows; training ones to its training split."""
    held_out = rollout(gateway, seed=1_000_001, mode="eval")
    assert held_out["status"] == "ok" and held_out["result"]["reward"] == 1.0, held_out
    assert summary(held_out)["split"] == "test"
    assert summary(held_out)["question"] == "What is 7 + 800?"  # test row 1_000_001 % 3
    assert summary(rollout(gateway, seed=1_000_001))["split"] == "train"


def test_a_scorer_that_raises_fails_its_rollout_with_its_message(gateway) -> None:
    outcome = rollout(gateway, seed=2, config={"behaviour": "raise"})
    assert outcome["status"] == "failed", outcome
    assert outcome["error"]["kind"] == "task_app_error"
    assert "ValueError: the scorer lost its answer key" in outcome["error"]["message"]
    assert rollout(gateway, seed=2)["result"]["reward"] == 1.0  # and the app serves on


def test_a_rollout_that_hangs_is_stopped_by_the_rollout_timeout(gateway) -> None:
    outcome = rollout(gateway, seed=3, config={"behaviour": "hang"}, timeout_s=1.0)
    assert outcome["status"] == "failed", outcome
    assert outcome["error"]["kind"] == "timeout"
    assert "within 1s (asked it to terminate the rollout)" in outcome["error"]["message"]
    assert outcome["duration_s"] < 5
    # Stopped in the container too, through the contract's own route: its record says so.
    process, _org, token, _runner, _policy = gateway
    with GatewayClient(process.url, token) as client:
        port = client.get("sums")["managed"]["port"]
    record = httpx.get(f"http://127.0.0.1:{port}/rollouts/{outcome['run_id']}").json()
    assert record["status"] == "terminated", record
    assert rollout(gateway, seed=3)["result"]["reward"] == 1.0


VALIDATE = """
import json, sys
from synth_containers import RolloutResult
from synth_containers.http_models import RolloutRequestModel
for body in json.load(sys.stdin):
    RolloutRequestModel.model_validate(body).policy.to_inference_target()
record = RolloutResult(
    rollout_id="run-abc", reward=0.25, task_id="t", reward_details={"hits": 3}
).to_dict()
print(json.dumps(record))
"""


def test_our_requests_validate_against_synth_containers_own_model() -> None:
    """Every shape of request we send, through synth-containers' RolloutRequestModel (which
    forbids unknown fields); and its own RolloutResult record through our reader."""

    def request(run_id: str, url: str, mode: str = "rl") -> RolloutRequest:
        return RolloutRequest.model_validate(
            {
                "run_id": run_id,
                "env": {"seed": 7, "config": {"level": 2}},
                "policy": {"config": {"inference_url": url, "model": "job", "max_tokens": 9}},
                "mode": mode,
                "training_session_id": "job-1",
            }
        )

    plain = request("run-abc", "http://127.0.0.1:9/rollouts/r1")
    bodies = [
        containers.rollout_body(plain),
        containers.rollout_body(
            request("run-abc", "http://127.0.0.1:9/rollouts/r1", "eval"), "test", {"q": 1}
        ),
        containers.rollout_body(request("r_" * 90, "http://h:9/r?route=a")),  # not an id
    ]
    assert bodies[2]["rollout_id"].startswith("rlnode-") and "base_url" not in bodies[2]["policy"]
    assert bodies[2]["policy"]["inference_url"] == "http://h:9/r/v1/chat/completions?route=a"
    assert (
        bodies[1]["policy"]["inference_url"] == "http://127.0.0.1:9/rollouts/r1/v1/chat/completions"
    )
    checked = subprocess.run(
        [synth_python(), "-c", VALIDATE],
        input=json.dumps(bodies),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stderr
    response = containers.rollout_response(plain, json.loads(checked.stdout))
    assert response.metrics.episode_returns == [0.25]
    assert response.metrics.details == {"hits": 3.0}
