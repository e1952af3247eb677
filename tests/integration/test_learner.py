"""The learner as the job owner, end to end on the CPU: a real broker, vault, gateway with
the managed copy-task Task App, a rollout-generator, the learner, and the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from rlnode.bus import Bus
from rlnode.bus.localbroker import free_port
from rlnode.examples import example_job, task_app_path
from rlnode.messages import JobConfig, JobEvent, JobEventType, JobRequest, topics
from rlnode.models.build import init_tiny_model
from rlnode.node.processes import ServiceProcess
from rlnode.sdk.gateway import GatewayClient
from rlnode.sdk.vault import VaultClient
from rlnode.service.registry import SERVICES_BY_NAME
from rlnode.testing import unique_id
from tests.integration.stack import start_stack

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def node(tmp_path_factory, kafka_broker):
    directory = tmp_path_factory.mktemp("learner-stack")
    stack = start_stack(directory)
    with GatewayClient(stack.gateway.url, stack.org_token) as gateway:
        gateway.register("copy", command=[sys.executable, str(task_app_path("copy_task"))])
        assert gateway.verify("copy")["ok"]
    model = init_tiny_model(directory / "tiny", seed=0)
    generator = stack.generator(
        "gen",
        kafka_broker.bootstrap_servers,
        GENERATOR_WORK_GROUP=unique_id("gen"),
        GENERATOR_CONCURRENCY="64",
        GENERATOR_MAX_BATCH_SIZE="64",
    )
    generator.wait_healthy()
    yield stack, model, stack.learner_token(), directory
    stack.stop()


@pytest.fixture(scope="module")
def learner_group() -> str:
    """One group and one database for the module, as on a real node: a learner in a new
    group would read every earlier job request again and start those jobs a second time."""
    return unique_id("learner")


@pytest.fixture(autouse=True)
def stop_learners_after_each_test(node):
    yield
    stack = node[0]
    for process in [p for p in stack.processes if p.spec.name == "learner"]:
        process.stop()
        stack.processes.remove(process)


def start_learner(
    node, kafka_broker, name: str = "learner", group: str | None = None, **env: str
) -> ServiceProcess:
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
            "DATABASE_URL": f"sqlite:///{directory / 'learner.sqlite3'}",
            "RLNODE_DATA_DIR": str(directory / "learner-data"),
            # One checkpoint store for the learner and the generators, as on a node.
            "RLNODE_CHECKPOINT_DIR": str(stack.checkpoint_store),
            "LEARNER_MODEL_DIRS": json.dumps([str(directory)]),
            **env,
        },
    ).start()
    stack.processes.append(learner)
    learner.wait_healthy()
    return learner


def child_commands(pid: int) -> list[str]:
    """Command lines of a process's children (from any of its threads), from /proc."""
    return [
        Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


class User:
    """The org's side of the bus in these tests: job requests published as the org (or with
    another token)."""

    def __init__(self, bus: Bus, stack) -> None:
        self.bus, self.stack = bus, stack

    def job_token(self, job_id: str, org_token: str | None) -> str:
        """A job token minted, as the SDK does, from `org_token` (default: the org's)."""
        with VaultClient(self.stack.vault.url, org_token or self.stack.org_token) as vault:
            return vault.create_job_token(job_id)

    async def start(
        self,
        config: JobConfig,
        job_id: str | None = None,
        token: str | None = None,
        raw_token: str | None = None,
    ) -> str:
        """`token`: the org token the job token is minted from; `raw_token`: sent as it is."""
        job_id = job_id or unique_id("job")
        await self.bus.publish(
            JobRequest(
                job_id=job_id,
                org_id=self.stack.org_id,
                token=raw_token or self.job_token(job_id, token),
                config=config,
            )
        )
        return job_id

    async def cancel(self, job_id: str, token: str | None = None, reason: str | None = None):
        await self.bus.publish(
            JobRequest(
                job_id=job_id,
                org_id=self.stack.org_id,
                token=self.job_token(job_id, token),
                action="cancel",
                reason=reason,
            )
        )


@pytest.fixture
async def user(node, make_bus) -> User:
    bus = make_bus("user")
    await bus.start()
    return User(bus, node[0])


def copy_config(model: Path, steps: int, **training) -> JobConfig:
    return example_job(
        "copy_task",
        model,
        steps=steps,
        **{"group_size": 8, "optimizer": {"lr": 5e-3}, "checkpoint_every": 10, **training},
    )


async def watch(
    make_bus, job_id: str, until, within_s: float, logs: tuple[ServiceProcess, ...] = ()
) -> list[JobEvent]:
    """The job's events from the start until one of the types in `until` (or, given a
    function, until it returns true for an event; given None, all of them within the time).
    Past the time it says what it waited for, the job's last events and the end of each of
    `logs`."""
    bus = make_bus("watcher")
    events: list[JobEvent] = []
    done = asyncio.Event()
    if until is None:
        stop = lambda _e: False  # noqa: E731
    else:
        stop = until if callable(until) else (lambda e: e.type in until)

    async def on_event(event: JobEvent, _d) -> None:
        if event.job_id == job_id:
            events.append(event)
            if stop(event):
                done.set()

    bus.subscribe(topics.JOB_EVENTS, on_event, group_id=None)
    await bus.start()
    try:
        if until is None:
            await asyncio.sleep(within_s)
        else:
            try:
                await asyncio.wait_for(done.wait(), within_s)
            except TimeoutError:
                # What it waited for, and how far the job got: CI keeps no node log.
                said = [f"{e.type.value}: {e.message}" for e in events[-8:]]
                raise AssertionError(
                    f"job {job_id}: no {until} within {within_s:g}s; "
                    f"{len(events)} event(s), the last: {said}"
                    + "".join(f"\n--- {p.log_path}, its end:\n{p.log_tail(6000)}" for p in logs)
                ) from None
    finally:
        await bus.stop()
    return events


# LoRA on a model trained from random weights needs its embedding trained too: with the
# adapters alone (rank 16 or 64, lr 1e-3 to 3e-2) the copy task gains +0.01 in 150 steps,
# as much as full fine-tuning with the embedding frozen (docs/decisions.md, "LoRA").
LORA = {"rank": 16, "alpha": 32, "modules_to_save": ["embed_tokens"]}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("lora", [None, LORA], ids=["full-weights", "lora"])
async def test_a_job_learns_the_copy_task(
    node, kafka_broker, make_bus, learner_group, user, lora
) -> None:
    _stack, model, _token, _directory = node
    learner = start_learner(node, kafka_broker, group=learner_group)
    # 8 prompts x 16 samples, lr 3e-3, 2 optimizer steps per step (the copy-task defaults);
    # 30 s through the services on 2 quiet CPU cores. The smallest run that still fails
    # when learning breaks (a learner that does not learn stays near 0.01).
    steps = int(os.environ.get("RLNODE_E2E_STEPS", "40"))
    # At a constant rate, as the threshold below was measured: the file's cosine decay
    # (against late collapse) learns less in 40 steps (in-process, seeds 0-7: full +0.12 to
    # +0.17, LoRA +0.11 to +0.15).
    constant = {"schedule": {"decay": "constant"}}
    job_id = await user.start(
        example_job(
            "copy_task", model, steps=steps, checkpoint_every=10, lora=lora, optimizer=constant
        )
    )
    events = await watch(
        make_bus, job_id, {JobEventType.COMPLETED, JobEventType.FAILED, JobEventType.REJECTED}, 900
    )
    kinds = [e.type for e in events]
    assert JobEventType.COMPLETED in kinds, [e.message for e in events[-5:]]
    assert kinds[:2] == [JobEventType.ACCEPTED, JobEventType.STARTED]
    train = [e.data for e in events if e.type is JobEventType.TRAIN_STEP]
    assert [d["step"] for d in train] == list(range(1, steps + 1))
    first, last = train[:5], train[-5:]
    mean = lambda xs: sum(d["reward_mean"] for d in xs) / len(xs)  # noqa: E731
    print("rewards", [round(d["reward_mean"], 2) for d in train])
    print("waited for data (s)", round(sum(d["wait_s"] for d in train), 1))
    print("computed (s)", round(sum(d["compute_s"] for d in train), 1))
    # bench/inprocess.py with this config at 40 steps, seeds 0-7: full weights gain +0.14 to
    # +0.26 (median +0.18), LoRA +0.13 to +0.31 (median +0.21); a learner that does not
    # learn, about 0. +0.07 leaves both margins at half the smallest gain or more.
    assert mean(last) >= mean(first) + 0.07
    assert all(d["staleness_max"] <= 1 for d in train)  # max_async 1
    assert JobEventType.WEIGHTS_LOADED in kinds and JobEventType.CHECKPOINT_SAVED in kinds
    if lora is not None:  # adapters (and the embedding) synced, not the whole model
        published = [e.data for e in events if e.type is JobEventType.WEIGHTS_PUBLISHED]
        whole = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        print("bytes per version", published[-1]["size_bytes"], "of", whole)
        assert all(p["size_bytes"] < whole for p in published)
    assert learner.stop() == 0


@pytest.mark.timeout(600)
async def test_bad_requests_are_rejected_and_the_learner_keeps_serving(
    node, kafka_broker, make_bus, learner_group, user
) -> None:
    from aiokafka import AIOKafkaProducer

    stack, model, _token, _directory = node
    start_learner(node, kafka_broker, name="intake", group=learner_group)
    _other_org, other_token = stack.vault.new_org()
    config = copy_config(model, steps=1)
    cases = {
        "unknown-app": (
            stack.org_token,
            config.model_copy(
                update={"task_app": config.task_app.model_copy(update={"name": "nope"})}
            ),
            "no Task App named 'nope'",
        ),
        "no-secret": (
            stack.org_token,
            config.model_copy(
                update={"task_app": config.task_app.model_copy(update={"secret": "MISSING"})}
            ),
            "has no secret 'MISSING'",
        ),
        "too-many-gpus": (
            stack.org_token,
            config.model_copy(
                update={"topology": config.topology.model_copy(update={"training_gpus": 4})}
            ),
            "no GPU is visible",
        ),
        "other-org": (other_token, config, "cannot act on org"),
        "bad-token": ("rln1.garbage.token", config, "token was refused"),
        "org-token": (stack.org_token, config, "job requests carry a job token"),
    }
    raw = {"bad-token", "org-token"}  # sent as they are, not minted into a job token
    jobs = {
        name: await user.start(
            cfg,
            unique_id(name),
            token=None if name in raw else token,
            raw_token=token if name in raw else None,
        )
        for name, (token, cfg, _) in cases.items()
    }
    raw = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap_servers)
    await raw.start()
    garbage_job = unique_id("garbage")
    await raw.send_and_wait(topics.JOB_REQUESTS, b"{this is not json", key=garbage_job.encode())
    wrong_schema = unique_id("wrong-schema")
    await raw.send_and_wait(
        topics.JOB_REQUESTS,
        f'{{"schema": "rlnode.JobRequest/1", "job_id": "{wrong_schema}", "org_id": "{stack.org_id}", "token": "t", "action": "start", "config": {{"model": 3}}}}'.encode(),
        key=wrong_schema.encode(),
    )
    await raw.stop()
    for name, (_token, _cfg, says) in cases.items():
        events = await watch(
            make_bus, jobs[name], {JobEventType.REJECTED, JobEventType.ACCEPTED}, 120
        )
        assert events[-1].type is JobEventType.REJECTED, (name, [e.message for e in events])
        assert says in events[-1].data["reason"], (name, events[-1].data["reason"])
    events = await watch(make_bus, wrong_schema, {JobEventType.REJECTED}, 60)
    assert "config.model" in events[-1].data["reason"]
    # ... and it still serves the next good job.
    good = await user.start(copy_config(model, steps=2))
    events = await watch(
        make_bus, good, {JobEventType.COMPLETED, JobEventType.FAILED, JobEventType.REJECTED}, 300
    )
    assert events[-1].type is JobEventType.COMPLETED or JobEventType.COMPLETED in [
        e.type for e in events
    ]
    # A second use of a job id is refused.
    await user.start(copy_config(model, steps=2), good)
    events = await watch(make_bus, good, {JobEventType.REJECTED}, 60)
    assert "was used already" in events[-1].data["reason"]


@pytest.mark.timeout(900)
async def test_a_learner_killed_mid_job_resumes_with_nothing_lost_or_trained_twice(
    node, kafka_broker, make_bus, learner_group, user
) -> None:
    _stack, model, _token, _directory = node
    group = learner_group
    first = start_learner(node, kafka_broker, name="resume", group=group)
    steps = 14
    job_id = await user.start(copy_config(model, steps, checkpoint_every=4))
    # Kill it once a checkpoint (step 4) exists and training has gone past it.
    await watch(
        make_bus, job_id, lambda e: e.type is JobEventType.TRAIN_STEP and e.data["step"] >= 6, 300
    )
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    start_learner(node, kafka_broker, name="resume", group=group)
    events = await watch(make_bus, job_id, {JobEventType.COMPLETED, JobEventType.FAILED}, 600)
    kinds = [e.type for e in events]
    assert JobEventType.COMPLETED in kinds, [e.message for e in events[-5:]]
    started = [e for e in events if e.type is JobEventType.STARTED]
    assert "resumed" in started[-1].message
    # Every work item of every step was trained exactly once, across both learners.
    store = node[0].checkpoint_store
    checkpoints = store / node[0].org_id / job_id / "checkpoints"
    state = json.loads((sorted(checkpoints.glob("step-*"))[-1] / "trainer_state.json").read_text())
    from rlnode.training.loop import trained_work_ids, work_id

    expected = [
        str(work_id(job_id, s, p, g)) for s in range(steps) for p in range(8) for g in range(8)
    ]
    trained = trained_work_ids(checkpoints)
    assert sorted(trained) == sorted(expected) and state["step"] == steps


@pytest.mark.timeout(600)
async def test_cancel_stops_a_running_job_and_a_queued_one(
    node, kafka_broker, make_bus, learner_group, user
) -> None:
    stack, model, _token, _directory = node
    start_learner(node, kafka_broker, name="cancel", group=learner_group)
    running, queued = unique_id("running"), unique_id("queued")
    for job_id in (running, queued):  # one job at a time: the second waits in the queue
        await user.start(copy_config(model, steps=500, checkpoint_every=1000), job_id)
        # Requests of different jobs sit in different partitions: no order between them.
        await watch(make_bus, job_id, {JobEventType.STARTED, JobEventType.QUEUED}, 120)
    events = await watch(make_bus, queued, {JobEventType.QUEUED}, 120)
    await user.cancel(queued, reason="changed my mind")
    events = await watch(make_bus, queued, {JobEventType.CANCELLED}, 60)
    assert events[-1].data["reason"] == "changed my mind"
    await watch(
        make_bus, running, lambda e: e.type is JobEventType.TRAIN_STEP and e.data["step"] >= 2, 300
    )
    # Another org cannot cancel it ...
    _other_org, other_token = stack.vault.new_org()
    await user.cancel(running, token=other_token)
    # ... its owner can.
    await user.cancel(running)
    events = await watch(make_bus, running, {JobEventType.CANCELLED, JobEventType.FAILED}, 120)
    kinds = [e.type for e in events]
    rejected = [e for e in events if e.type is JobEventType.REJECTED]
    assert rejected and "cannot act on org" in rejected[0].data["reason"]
    # The learner's last word on the job is job.cancelled (a generator may still report
    # loading the last weights after it: another producer, the same partition).
    ended = [e for e in events if e.source == "learner"][-1]
    assert ended.type is JobEventType.CANCELLED, kinds
    assert JobEventType.FAILED not in kinds
    stopped_at = ended.data["step"]
    assert 2 <= stopped_at < 500
    # What was learned is kept: a checkpoint at the step it stopped.
    saved = [e for e in events if e.type is JobEventType.CHECKPOINT_SAVED]
    assert saved and saved[-1].data["step"] == stopped_at
    checkpoint = stack.checkpoint_store / stack.org_id / running / "checkpoints"
    assert (checkpoint / f"step-{stopped_at:06d}" / "model.safetensors").exists()
    # The learner takes the next job, and nothing more of the cancelled one is trained.
    follow_up = await user.start(copy_config(model, steps=2))
    events = await watch(make_bus, follow_up, {JobEventType.COMPLETED, JobEventType.FAILED}, 300)
    assert JobEventType.COMPLETED in [e.type for e in events], [e.message for e in events]
    everything = await watch(make_bus, running, None, 5)
    assert not [
        e for e in everything if e.type is JobEventType.TRAIN_STEP and e.data["step"] > stopped_at
    ]


@pytest.mark.timeout(600)
async def test_a_data_parallel_learner_trains_over_two_ranks(
    node, kafka_broker, make_bus, learner_group, user
) -> None:
    """LEARNER_DEVICES=cpu,cpu: the service is rank 0 and spawns rank 1 (gloo), as it would
    over two GPUs with NCCL; after the job the rank is gone."""
    _stack, model, _token, _directory = node
    # A rank stuck in a collective fails the job in 120 s, with the stacks of the ranks that
    # live in its message and in the learner's log (both ranks write there): #49's hang
    # timed the test out at 300 s with nothing said.
    learner = start_learner(
        node,
        kafka_broker,
        name="ddp",
        group=learner_group,
        LEARNER_DEVICES="cpu,cpu",
        LEARNER_RANK_TIMEOUT_S="120",
    )
    job_id = await user.start(copy_config(model, steps=4, checkpoint_every=2), unique_id("ddp"))
    done = {JobEventType.COMPLETED, JobEventType.FAILED}
    events = await watch(make_bus, job_id, done, 300, logs=(learner,))
    assert JobEventType.COMPLETED in [e.type for e in events], (
        [e.message for e in events[-5:]],
        learner.log_tail(6000),
    )
    train = [e.data for e in events if e.type is JobEventType.TRAIN_STEP]
    assert [d["step"] for d in train] == [1, 2, 3, 4]
    assert all(d["world_size"] == 2 for d in train)
    assert any(d["trained_samples"] > 0 and d["loss"] != 0.0 for d in train)
    # No child process left but multiprocessing's resource tracker.
    children = child_commands(learner.proc.pid)
    assert not [c for c in children if "resource_tracker" not in c], children
