"""Kill any part of a running node and lose nothing. On the embedded node (`rlnode up`'s:
its own Apache Kafka, every service a process, supervision restarting what dies), a job is
running when one process is SIGKILLed mid-step: the broker, the vault, either gateway (the
one that runs the managed Task App, or the second, which only runs rollouts), the
generator, the learner, the checkpoint-server or the managed Task App. The job completes;
the chain of its checkpoints trained each work item exactly once; every step of the run
that finished it shows once in `train.step`; checkpoints served before the kill still are;
every job request, job event and dead letter the broker held before the kill it still
holds, and a killed broker made no service start again."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from rlnode import testing
from rlnode.bus import clients
from rlnode.examples import example_job
from rlnode.messages import JobEventType, topics
from rlnode.models.build import init_tiny_model
from rlnode.node import chaos
from rlnode.node.chaos import BROKER, Supervision, learner_jobs, task_app_target
from rlnode.node.local import LocalNode, NodeOptions, Org
from rlnode.sdk.checkpoints import CheckpointClient
from rlnode.service.registry import CHECKPOINT_SERVER, GATEWAY, LEARNER, VAULT
from rlnode.testing import unique_id

# Enough steps that the kill lands mid-job: since #18 a step of this job takes ~0.1 s, and
# 8 steps could all be done before the kill (the broker's then took every event with it).
STEPS, PROMPTS, GROUP = 30, 2, 4
TASK_APP = "copy"


Running = tuple[LocalNode, Org, Path, Supervision]


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[Running]:
    directory = tmp_path_factory.mktemp("chaos")
    options = NodeOptions(
        data_dir=directory / "node",
        env={"rollout-generator": {"GENERATOR_CONCURRENCY": "16"}},
        gateways=2,  # the generator spreads its work over both; either may be killed
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
            supervision.stop()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def served(node: LocalNode, org: Org, job_id: str) -> list[int]:
    try:
        with CheckpointClient(node.url(CHECKPOINT_SERVER.name), org.token) as server:
            return [c["step"] for c in server.checkpoints(job_id) if c["on_disk"]]
    except Exception:
        return []


def wait_until(check, timeout_s: float, what: str, supervision: Supervision):
    try:
        return testing.wait_until(check, timeout_s, what)
    except TimeoutError as e:
        raise AssertionError(f"{e}; supervision: {supervision.said}") from None


def dead_letter_one(node: LocalNode, supervision: Supervision) -> None:
    """A job request that is not JSON, and wait until the learner has dead-lettered it."""

    def dead_letters() -> int:
        only = (topics.DEAD_LETTERS,)
        return len(asyncio.run(chaos.held_records(node, only)))

    before = dead_letters()

    async def send() -> None:
        producer = clients.producer(node.kafka_settings(), "chaos")
        await producer.start()
        try:
            await producer.send_and_wait(topics.JOB_REQUESTS, b"{not json", key=b"chaos")
        finally:
            await producer.stop()

    asyncio.run(send())
    wait_until(lambda: dead_letters() > before, 60, "the bad request dead-lettered", supervision)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "target",
    [
        "taskapp",
        CHECKPOINT_SERVER.name,
        "rollout-generator/gen0",
        VAULT.name,
        GATEWAY.name,
        f"{GATEWAY.name}/gw1",
        LEARNER.name,
        BROKER,
    ],
)
def test_a_job_survives_a_sigkill_of(node: Running, target: str) -> None:
    survives(node, target)


def survives(node: Running, target: str) -> None:
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

    if target == BROKER:  # a dead letter it must keep
        dead_letter_one(running, supervision)
    job_id = asyncio.run(start())
    # Mid-job: a checkpoint is served and training goes on past it.
    wait_until(
        lambda: (
            (s := learner_jobs(running, org))
            and s.get(job_id, {}).get("step", 0) >= 2
            and served(running, org, job_id)
        ),
        300,
        f"{job_id} at step 2 with a checkpoint served",
        supervision,
    )
    before = served(running, org, job_id)
    killed = task_app_target(org, TASK_APP) if target == "taskapp" else target
    orgs = {org.org_id: org}
    # A service that exited on its own (CI once saw the second gateway gone at this point)
    # is started again by supervision first: the kill must land on a live process.
    wait_until(lambda: chaos.is_running(running, killed, orgs), 60, f"{killed} runs", supervision)
    restarts_before = dict(running.restarts)
    task_app_pid = chaos.pid_of(running, task_app_target(org, TASK_APP), orgs)
    held_before = asyncio.run(chaos.held_records(running))
    progress = (learner_jobs(running, org) or {}).get(job_id, {})
    assert progress.get("status") == "running" and progress.get("step", STEPS) < STEPS, (
        f"the job is not mid-way before the kill: {progress}"
    )
    chaos.kill(running, killed, orgs)
    if target == GATEWAY.name:
        # Its Task App goes with it (the gateway started after it starts another).
        wait_until(lambda: not alive(task_app_pid), 10, "the Task App gone", supervision)

    done = wait_until(
        lambda: (
            (s := (learner_jobs(running, org) or {}).get(job_id))
            and s["status"] in ("completed", "failed")
            and s
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
    assert chaos.trained_once(checkpoints, job_id, STEPS, PROMPTS, GROUP) == (0, 0)

    # The run that finished the job reported each of its steps once. (A learner that is
    # killed trains the steps after its last checkpoint again, in a run of its own.)
    events = running.job_events(org, job_id, "chaos-watcher")
    starts = [i for i, e in enumerate(events) if e.type is JobEventType.STARTED]
    assert starts, [e.type for e in events]
    last_run = events[starts[-1] :]
    steps = [e.data["step"] for e in last_run if e.type is JobEventType.TRAIN_STEP]
    resumed_from = STEPS - len(steps)
    assert steps == list(range(resumed_from + 1, STEPS + 1)), steps
    if target != LEARNER.name:
        assert len(starts) == 1 and resumed_from == 0
    # Every request, event and dead letter from before the kill is still there.
    lost = held_before - asyncio.run(chaos.held_records(running))
    assert not lost, sorted(lost)[:5]
    if target == BROKER:  # and no service had to start again
        assert any(topic == topics.DEAD_LETTERS for topic, *_ in held_before)
        services = {key: n for key, n in running.restarts.items() if key in running.processes}
        assert services == {k: n for k, n in restarts_before.items() if k in running.processes}

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
    wait_until(lambda: chaos.all_healthy(running), 120, "every service healthy", supervision)
