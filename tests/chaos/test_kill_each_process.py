"""Kill any part of a running node and lose nothing. On the embedded node (`rlnode up`'s:
its own broker, every service a process, supervision restarting what dies), a job is
running when one process is SIGKILLed mid-step: the broker, the vault, the gateway, the
generator, the learner, the checkpoint-server or the managed Task App. The job completes;
the chain of its checkpoints trained each work item exactly once; every step of the run
that finished it shows once in `train.step`; checkpoints served before the kill still are."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rlnode.examples import example_job
from rlnode.messages import JobEvent, JobEventType
from rlnode.models.build import init_tiny_model
from rlnode.node.local import LocalNode, NodeOptions, Org
from rlnode.sdk.checkpoints import CheckpointClient
from rlnode.sdk.gateway import GatewayClient
from rlnode.service.registry import CHECKPOINT_SERVER, GATEWAY, LEARNER, VAULT
from rlnode.testing import unique_id
from rlnode.training.loop import trained_work_ids, work_id

STEPS, PROMPTS, GROUP = 8, 2, 4
TASK_APP = "copy"


class Supervision(threading.Thread):
    """What `rlnode up` does between its start and its stop: a round of `supervise` every
    0.2 s (dead services and a dead broker are started again)."""

    def __init__(self, node: LocalNode) -> None:
        super().__init__(daemon=True, name="node supervision")
        self.node = node
        self.said: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.2):
            self.said.extend(self.node.supervise())


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[tuple[LocalNode, Org, Path, Supervision]]:
    directory = tmp_path_factory.mktemp("chaos")
    options = NodeOptions(
        data_dir=directory / "node",
        env={"rollout-generator": {"GENERATOR_CONCURRENCY": "16"}},
    )
    with LocalNode(options) as running:
        org = running.create_org(unique_id("org"), {"ENVIRONMENT_API_KEY": unique_id("tk")})
        assert running.register_example_task_app(org, TASK_APP, "copy_task")["ok"]
        model = init_tiny_model(directory / "tiny", seed=0)
        supervision = Supervision(running)
        supervision.start()
        try:
            yield running, org, model, supervision
        finally:
            supervision.stopping.set()
            supervision.join()


def target_pid(node: LocalNode, org: Org, target: str) -> int:
    if target == "broker":
        assert node.broker is not None and node.broker.pid is not None
        return node.broker.pid
    if target == "taskapp":
        with GatewayClient(node.url(GATEWAY.name), org.token) as gateway:
            pid = gateway.get(TASK_APP)["managed"]["pid"]
        assert pid, "the managed Task App runs"
        return pid
    process = node.processes[target].proc
    assert process is not None
    return process.pid


def all_healthy(node: LocalNode) -> bool:
    try:
        return all(
            httpx.get(p.health_url, timeout=5).status_code == 200 for p in node.processes.values()
        )
    except httpx.TransportError:
        return False


def summary(node: LocalNode, org: Org, job_id: str) -> dict | None:
    """The job as its learner records it (None while it cannot say). Not the checkpoint-
    server's summary: that is built from events, and events a killed broker held are gone."""
    try:
        response = httpx.get(
            node.url(LEARNER.name) + "/v1/jobs",
            headers={"Authorization": f"Bearer {org.token}"},
            timeout=5,
        )
        jobs = {job["job_id"]: job for job in response.raise_for_status().json()}
    except httpx.HTTPError:  # down or restarting
        return None
    return jobs.get(job_id)


def served(node: LocalNode, org: Org, job_id: str) -> list[int]:
    try:
        with CheckpointClient(node.url(CHECKPOINT_SERVER.name), org.token) as server:
            return [c["step"] for c in server.checkpoints(job_id) if c["on_disk"]]
    except Exception:
        return []


def wait_until(check, timeout_s: float, what: str, supervision: Supervision):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout_s:.0f}s: {what}; supervision: {supervision.said}")


async def job_events(node: LocalNode, org: Org, job_id: str) -> list[JobEvent]:
    async with node.jobs(org, "chaos-watcher") as jobs:
        return [e async for e in jobs.events(job_id, follow=False)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "target",
    [
        "taskapp",
        CHECKPOINT_SERVER.name,
        "rollout-generator/gen0",
        VAULT.name,
        GATEWAY.name,
        LEARNER.name,
        "broker",
    ],
)
def test_a_job_survives_a_sigkill_of(node, target: str) -> None:
    running, org, model, supervision = node
    config = example_job(
        "copy_task",
        model,
        steps=STEPS,
        prompts_per_step=PROMPTS,
        group_size=GROUP,
        checkpoint_every=2,
        max_async=1,
    )

    async def start() -> str:
        async with running.jobs(org, "chaos") as jobs:
            return await jobs.start(config, unique_id("chaos"))

    job_id = asyncio.run(start())
    # Mid-job: a checkpoint is served and training goes on past it.
    wait_until(
        lambda: (
            (s := summary(running, org, job_id)) and s["step"] >= 2 and served(running, org, job_id)
        ),
        300,
        f"{job_id} at step 2 with a checkpoint served",
        supervision,
    )
    before = served(running, org, job_id)
    restarts_before = dict(running.restarts)
    os.kill(target_pid(running, org, target), signal.SIGKILL)

    done = wait_until(
        lambda: (
            (s := summary(running, org, job_id)) and s["status"] in ("completed", "failed") and s
        ),
        420,
        f"{job_id} ended after the {target} was killed",
        supervision,
    )
    assert done["status"] == "completed", done
    if target != "taskapp":  # the gateway starts its Task Apps again, not the node
        wanted = restarts_before.get(target, 0) + 1
        wait_until(lambda: running.restarts.get(target, 0) == wanted, 60, "restarted", supervision)

    # The chain of checkpoints trained each work item once: none missing, none twice.
    checkpoints = running.data_dir / "checkpoints" / org.org_id / job_id / "checkpoints"
    trained = trained_work_ids(checkpoints)
    expected = {
        str(work_id(job_id, s, p, g))
        for s in range(STEPS)
        for p in range(PROMPTS)
        for g in range(GROUP)
    }
    assert Counter(trained).most_common(1)[0][1] == 1, "a work item was trained twice"
    assert set(trained) == expected

    # The run that finished the job reported each of its steps once. (A learner that is
    # killed trains the steps after its last checkpoint again, in a run of its own; the
    # broker's events from before it died are gone with it.)
    events = asyncio.run(job_events(running, org, job_id))
    starts = [i for i, e in enumerate(events) if e.type is JobEventType.STARTED]
    assert starts, [e.type for e in events]
    last_run = events[starts[-1] :]
    steps = [e.data["step"] for e in last_run if e.type is JobEventType.TRAIN_STEP]
    resumed_from = STEPS - len(steps)
    assert steps == list(range(resumed_from + 1, STEPS + 1)), steps
    if target not in (LEARNER.name, "broker"):
        assert len(starts) == 1 and resumed_from == 0

    # What was served before the kill still is, and answers.
    after = wait_until(
        lambda: (found := served(running, org, job_id)) and STEPS in found and found,
        60,
        "the final checkpoint indexed",
        supervision,
    )
    assert set(before) <= set(after)
    with CheckpointClient(running.url(CHECKPOINT_SERVER.name), org.token) as server:
        answer = server.complete(f"{job_id}@{before[0]}", "Copy: abc", max_tokens=4)
    assert answer["choices"][0]["text"] is not None
    wait_until(lambda: all_healthy(running), 120, "every service healthy", supervision)
