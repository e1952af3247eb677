"""Environments written for other libraries, each registered the usual way (managed: the
gateway starts it as a sandbox user with the org's key injected, behind the Task App network
rules) and verified with `rlnode taskapp verify`, then one short job per library on the tiny
model through one node: every rollout of the job answered by the library's own code."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from rlnode.bus.localbroker import free_port
from rlnode.examples import example_job
from rlnode.messages import JobConfig, JobEventType
from rlnode.models.build import init_tiny_model
from rlnode.node.local import LocalNode, NodeOptions
from rlnode.testing import run_rlnode, unique_id
from tests.integration import test_env_openreward as openreward
from tests.integration import test_env_verifiers as verifiers

ROOT = Path(__file__).resolve().parents[2]


def environment_python(name: str) -> str:
    """The python of an environment library's own venv (tools/environment-venv)."""
    python = ROOT / ".venvs" / name / "bin" / "python"
    assert python.exists(), f"{python} is missing: run `make environments`"
    return str(python)


@pytest.fixture(scope="module")
def openreward_server(tmp_path_factory):
    """An OpenReward environment server of the user's, on this machine (its own venv)."""
    python, port = environment_python("openreward"), free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("openreward") / "env-server.log"
    command = [python, str(openreward.ENV_SERVER), "--port", str(port)]
    ready = lambda: httpx.get(url + "/health").is_success  # noqa: E731
    process = openreward.started(command, openreward.OFFLINE, log, ready)
    yield url, port
    openreward.stopped(process)


@pytest.fixture(scope="module")
def node(tmp_path_factory, openreward_server):
    directory = tmp_path_factory.mktemp("environments")
    # Managed Task Apps are isolated: the environment server's one port is let through.
    allow = json.dumps([f"127.0.0.1:{openreward_server[1]}"])
    options = NodeOptions(
        data_dir=directory / "node", env={"taskapp-gateway": {"GATEWAY_TASKAPP_ALLOW_TO": allow}}
    )
    with LocalNode(options) as running:
        org = running.create_org(unique_id("org"), {"ENVIRONMENT_API_KEY": unique_id("tk")})
        model = init_tiny_model(directory / "tiny", seed=0)
        yield running, org, model, directory


def cli(node, *args: str) -> str:
    running, org, _model, directory = node
    env = {
        **os.environ,
        "RLNODE_TOKEN": org.token,
        "KAFKA_BOOTSTRAP_SERVERS": running.bootstrap,
        "RLNODE_VAULT_URL": running.url("credential-vault"),
        "RLNODE_GATEWAY_URL": running.url("taskapp-gateway"),
        "RLNODE_DATA_DIR": str(directory / "user"),
    }
    result = run_rlnode(env, *args, timeout=300, cwd=directory)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def register(node, name: str, command: list[str], env: dict[str, str] | None = None) -> str:
    """`rlnode taskapp register NAME --command ... [--env K=V]` then `rlnode taskapp verify`."""
    extra = [f"--env={k}={v}" for k, v in (env or {}).items()]
    cli(node, "taskapp", "register", name, "--command", shlex.join(command), *extra)
    return cli(node, "taskapp", "verify", name)


def short_job(
    node, task_app: dict[str, Any], steps: int = 1, max_tokens: int = 16, model: Path | None = None
) -> JobConfig:
    model = model or node[2]
    job = example_job(
        "copy_task", model, steps=steps, prompts_per_step=2, group_size=2, checkpoint_every=100
    )
    return JobConfig.model_validate(
        job.model_dump(mode="json")
        | {"task_app": task_app, "sampling": {"max_tokens": max_tokens, "temperature": 1.0}}
    )


def train_steps(node, job: JobConfig) -> list[dict]:
    running, org, _model, _directory = node
    _job_id, events = running.run_job(org, job, idle_timeout_s=240)
    steps = [e.data for e in events if e.type is JobEventType.TRAIN_STEP]
    # What the failed episodes said (rollout.sample shows a step's failed ones).
    said = [
        f"{sample['failure_kind']}: {sample['failure_message']}"
        for e in events
        if e.type is JobEventType.ROLLOUT_SAMPLE
        for sample in e.data["samples"]
        if sample["status"] == "failed"
    ]
    # The tiny model samples at temperature 1 from random weights: now and then it ends an
    # answer before its first token. verifiers 0.3 aborts that rollout itself
    # (EmptyModelResponseError): the library's verdict, not a failure to run it.
    unexplained = [s for s in said if "EmptyModelResponseError" not in s]
    assert steps and not unexplained, said
    rollouts = job.training.prompts_per_step * job.training.group_size
    assert all(s["failed_rollouts"] < rollouts for s in steps), said
    return steps


def test_reasoning_gym_with_its_curriculum(node) -> None:
    command = [sys.executable, "-m", "rlnode.environments.reasoning_gym", "--processes", "2"]
    assert "ok" in register(node, "reasoning-gym", command).lower()
    task_app = {
        "name": "reasoning-gym",
        "env_config": {"task": "chain_sum", "system_prompt": "direct"},
        # Threshold 0: the level rises after every step, whatever the tiny model answers.
        "curriculum": {"start": 0, "max_level": 5, "threshold": 0.0, "patience": 1},
    }
    steps = train_steps(node, short_job(node, task_app, steps=2))
    assert [s["curriculum_level"] for s in steps] == [1, 2]
    assert "correct" in steps[0]["task_metrics"] and "level" in steps[0]["task_metrics"]


def test_a_textarena_game_trained_as_one_sequence(node) -> None:
    command = [sys.executable, "-m", "rlnode.environments.textarena", "--processes", "2"]
    assert "ok" in register(node, "textarena", command).lower()
    task_app = {"name": "textarena", "env_config": {"game": "GuessTheNumber-v0", "max_turns": 3}}
    steps = train_steps(node, short_job(node, task_app, max_tokens=8))
    # Each turn's prompt extended the last one's: every episode trained as one sample.
    assert steps[0]["merged_trajectories"] > 0 and steps[0]["per_turn_trajectories"] == 0


def test_an_openreward_environment_server_through_tool_calls(
    node, openreward_server, tool_model
) -> None:
    url, _port = openreward_server
    command = [environment_python("openreward"), "-m", "rlnode.environments.openreward"]
    command += ["--server", url, "--environment", "arithmeticenv", "--processes", "2"]
    assert "ok" in register(node, "openreward", command).lower()
    task_app = {"name": "openreward", "env_config": {"max_turns": 2}}
    # Its tools reach the model as OpenAI tools: a model whose chat template renders them.
    train_steps(node, short_job(node, task_app, max_tokens=48, model=tool_model))


def test_a_synth_container(node) -> None:
    script = ROOT / "tests" / "environments" / "synth_sums.py"
    verdict = register(node, "synth-sums", [environment_python("synth-containers"), str(script)])
    assert "ok" in verdict.lower()
    train_steps(node, short_job(node, {"name": "synth-sums"}))


# verifiers 0.4 runs its harness in a subprocess that calls the model through a relay the
# library starts on the app's own loopback port: the Task App rules let an app reach its
# own listening sockets (cgroups.py), and no one else's.
@pytest.mark.parametrize("version", ["0.3", "0.4"])
def test_a_published_style_verifiers_environment(node, version) -> None:
    app = verifiers.NODE_TASK_APPS[version]
    verifiers.environment_python(version)  # says what to run when its venv is missing
    name = f"verifiers-{version.replace('.', '')}"
    assert "ok" in register(node, name, app["command"], app["env"]).lower()
    train_steps(node, short_job(node, {"name": name, "env_config": app["env_config"]}))
