"""The learner as the job owner, end to end on the CPU: a real broker, vault, gateway with
the managed copy-task Task App, a rollout-generator, the learner, and the tiny model."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from rlnode import topics
from rlnode.engine.tiny import init_tiny_model
from rlnode.localbroker import free_port
from rlnode.messages import JobConfig, JobEvent, JobEventType, JobRequest, Trajectory
from rlnode.process import SERVICES_BY_NAME, ServiceProcess
from rlnode.sdk.gateway import GatewayClient
from rlnode.testing import unique_id
from tests.integration.stack import start_stack

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def node(tmp_path_factory, kafka_broker):
    directory = tmp_path_factory.mktemp("learner-stack")
    stack = start_stack(directory)
    with GatewayClient(stack.gateway.url, stack.org_token) as gateway:
        gateway.register("copy", command=[sys.executable, str(ROOT / "examples/taskapps/copy_task.py")])
        assert gateway.verify("copy")["ok"]
    model = init_tiny_model(directory / "tiny", seed=0)
    generator = stack.generator(
        "gen", kafka_broker.bootstrap_servers, GENERATOR_WORK_GROUP=unique_id("gen"),
        GENERATOR_CONCURRENCY="64", GENERATOR_MAX_BATCH_SIZE="64",
    )
    generator.wait_healthy()
    learner_token = stack.vault.service_token(["taskapps:read", "secrets:read"], service="learner")
    yield stack, model, learner_token, directory
    stack.stop()


def start_learner(node, kafka_broker, name: str = "learner", group: str | None = None) -> ServiceProcess:
    stack, _model, token, directory = node
    learner = ServiceProcess(
        SERVICES_BY_NAME["learner"],
        free_port(),
        directory / f"{name}.log",
        env={
            "KAFKA_BOOTSTRAP_SERVERS": kafka_broker.bootstrap_servers,
            "KAFKA_SESSION_TIMEOUT_MS": "6000",
            "KAFKA_HEARTBEAT_INTERVAL_MS": "2000",
            "LEARNER_VAULT_URL": stack.vault.url,
            "LEARNER_GATEWAY_URL": stack.gateway.url,
            "LEARNER_SERVICE_TOKEN": token,
            "LEARNER_GROUP_ID": group or "learner",
            "LEARNER_TRAJECTORY_GROUP_ID": f"{group or 'learner'}-trajectories",
            "DATABASE_URL": f"sqlite:///{directory / (name + '.sqlite3')}",
            "RLNODE_DATA_DIR": str(directory / "learner-data"),
        },
    ).start()
    stack.processes.append(learner)
    learner.wait_healthy()
    return learner


def copy_config(model: Path, steps: int, **training) -> JobConfig:
    return JobConfig.model_validate(
        {
            "model": {"source": str(model)},
            "task_app": {"name": "copy", "env_config": {"length": 3, "alphabet": "abc"}},
            "sampling": {"max_tokens": 6, "temperature": 1.0},
            "training": {
                "steps": steps, "prompts_per_step": 8, "group_size": 8, "learning_rate": 5e-3,
                "max_async": 1, "weight_sync_every": 1, "checkpoint_every": 10, **training,
            },
        }
    )


async def watch(make_bus, job_id: str, until: set[JobEventType], within_s: float) -> list[JobEvent]:
    bus = make_bus("watcher")
    events: list[JobEvent] = []
    done = asyncio.Event()

    async def on_event(event: JobEvent, _d) -> None:
        if event.job_id == job_id:
            events.append(event)
            if event.type in until:
                done.set()

    bus.subscribe(topics.JOB_EVENTS, on_event, group_id=None, commit="none")
    await bus.start()
    try:
        await asyncio.wait_for(done.wait(), within_s)
    finally:
        await bus.stop()
    return events


async def test_a_job_learns_the_copy_task(node, kafka_broker, make_bus) -> None:
    stack, model, _token, _directory = node
    learner = start_learner(node, kafka_broker, group=unique_id("learner"))
    job_id = unique_id("job")
    steps = int(os.environ.get('RLNODE_E2E_STEPS', '120'))
    producer = make_bus("user")
    await producer.start()
    await producer.publish(JobRequest(job_id=job_id, org_id=stack.org_id, token=stack.org_token, config=copy_config(model, steps)))
    events = await watch(make_bus, job_id, {JobEventType.COMPLETED, JobEventType.FAILED, JobEventType.REJECTED}, 900)
    kinds = [e.type for e in events]
    assert JobEventType.COMPLETED in kinds, [e.message for e in events[-5:]]
    assert kinds[:2] == [JobEventType.ACCEPTED, JobEventType.STARTED]
    train = [e.data for e in events if e.type is JobEventType.TRAIN_STEP]
    assert [d["step"] for d in train] == list(range(1, steps + 1))
    first, last = train[:5], train[-5:]
    mean = lambda xs: sum(d["reward_mean"] for d in xs) / len(xs)  # noqa: E731
    print("rewards", [round(d["reward_mean"], 2) for d in train])
    assert mean(last) >= mean(first) + 0.4
    assert all(d["staleness_max"] <= 1 for d in train)  # max_async 1
    assert JobEventType.WEIGHTS_LOADED in kinds and JobEventType.CHECKPOINT_SAVED in kinds
    assert learner.stop() == 0
