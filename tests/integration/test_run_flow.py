"""The production run flow on the CPU, as a user drives it: a whole node (vault, gateway,
generator, learner, checkpoint-server) on the test broker; `rlnode job start --watch` to
completion; listings; inference on `@latest` and an earlier step with the `openai` client;
parity of the served logprobs with the saved weights; a raw Kafka client driving a job."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from rlnode.bus.acls import confluent_config
from rlnode.bus.clients import connection
from rlnode.bus.reader import TopicReader
from rlnode.bus.settings import KafkaSettings
from rlnode.examples import example_job
from rlnode.examples.taskapps import calculator
from rlnode.messages import JobConfig, Trajectory, topics
from rlnode.messages.codec import decode
from rlnode.models.build import init_tiny_model
from rlnode.models.hf import load_tokenizer
from rlnode.node.local import LocalNode, NodeOptions
from rlnode.sdk.checkpoints import CheckpointClient, CheckpointError
from rlnode.service.openai_api import parse_tool_calls
from rlnode.testing import run_rlnode, unique_id, wait_until, waiting_for

STEPS = 4
EVAL_SEEDS = {"start": 1000, "count": 4}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    directory = tmp_path_factory.mktemp("run-flow")
    # A broker of its own (the node's embedded one): the session's holds every earlier
    # module's records, which a node's new consumer groups would read and dead-letter first
    # (signed by other tests' vaults).
    options = NodeOptions(
        data_dir=directory / "node",
        env={
            "rollout-generator": {"GENERATOR_CONCURRENCY": "64", "GENERATOR_MAX_BATCH_SIZE": "64"}
        },
    )
    with LocalNode(options) as running:
        org = running.create_org(unique_id("org"), {"ENVIRONMENT_API_KEY": unique_id("tk")})
        assert running.register_example_task_app(org, "copy", "copy_task")["ok"]
        model = init_tiny_model(directory / "tiny", seed=0)
        # The copy-task job every test and the demo run, as a file a user would pass.
        job = example_job(
            "copy_task",
            model,
            steps=STEPS,
            group_size=8,
            optimizer={"lr": 5e-3},
            minibatches=1,
            checkpoint_every=2,
        )
        # Held-out evaluation before training and every 2 steps: 4 seeds x 2 samples.
        evaluation = {"every": 2, "at_start": True, "seeds": EVAL_SEEDS, "samples": 2}
        # Its events into TensorBoard and MLflow under its directory, live.
        logging = {"tensorboard": True, "mlflow": True}
        job = JobConfig.model_validate(
            job.model_dump(mode="json") | {"eval": evaluation, "logging": logging}
        )
        config = directory / "job.json"
        config.write_text(job.model_dump_json(indent=2))
        yield running, org, config, directory


def org_kafka_login(running: LocalNode, org_id: str) -> dict:
    """`rlnode kafka-credentials ORG --json` as the node's operator runs it: the org's login
    for a Kafka client of its own (env), and its events topic."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAFKA_")}
    issued = run_rlnode(
        env | {"RLNODE_DATA_DIR": str(running.data_dir)},
        "kafka-credentials",
        org_id,
        "--json",
        timeout=120,
    )
    assert issued.returncode == 0, issued.stdout + issued.stderr
    return json.loads(issued.stdout)


@pytest.fixture(scope="module")
def org_login(node) -> dict:
    running, org, _config, _directory = node
    return org_kafka_login(running, org.org_id)


def cli(
    node, *args: str, timeout: float = 600, login: dict | None = None
) -> subprocess.CompletedProcess:
    running, org, _config, directory = node
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KAFKA_")},
        "RLNODE_TOKEN": org.token,
        # The org's own Kafka login, as its user has it; else the operator's.
        **(login["env"] if login else running.kafka_settings().connection_env()),
        "RLNODE_CHECKPOINT_URL": running.url("checkpoint-server"),
        "RLNODE_VAULT_URL": running.url("credential-vault"),
        "RLNODE_DATA_DIR": str(directory / "user"),
    }
    return run_rlnode(env, *args, timeout=timeout, cwd=directory)


@pytest.fixture(scope="module")
def finished_job(node) -> str:
    """One job run through the CLI: start --watch until it completes."""
    job_id = unique_id("job")
    result = cli(node, "job", "start", str(node[2]), "--job-id", job_id, "--watch")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{STEPS}/{STEPS}" in result.stdout and "job.completed" in result.stdout
    return job_id


def wait_indexed(client: CheckpointClient, job_id: str, steps: list[int]) -> list[dict]:
    """The checkpoint-server indexes from the topic: allow it a moment to catch up."""
    for _ in range(100):
        found = client.checkpoints(job_id)
        if sorted(c["step"] for c in found) == steps:
            return found
        time.sleep(0.2)
    raise AssertionError(f"checkpoints of {job_id}: {client.checkpoints(job_id)}")


def test_start_watch_list_status_and_plot(node, finished_job) -> None:
    running, org, _config, directory = node
    with CheckpointClient(running.url("checkpoint-server"), org.token) as server:
        found = wait_indexed(server, finished_job, [2, STEPS])
        assert all(c["on_disk"] for c in found)
        assert found[-1]["final"] is True
        models = server.models()
        assert {f"{finished_job}@2", f"{finished_job}@{STEPS}", f"{finished_job}@latest"} <= set(
            models
        )
    listed = cli(node, "job", "list")
    assert listed.returncode == 0 and finished_job in listed.stdout and "completed" in listed.stdout
    status = cli(node, "job", "status", finished_job)
    assert status.returncode == 0, status.stderr
    assert f"step       {STEPS}/{STEPS}" in status.stdout and f"2, {STEPS}" in status.stdout
    plot = cli(node, "job", "plot", finished_job, "--out", str(directory / "curve.png"))
    assert plot.returncode == 0, plot.stderr
    assert (directory / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The metrics file has one line per step.
    metrics = running.data_dir / "checkpoints" / org.org_id / finished_job / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))


def test_events_prints_a_jobs_events_as_json_lines(node, finished_job) -> None:
    """`rlnode events`: what shell users pipe into jq, one job's or the whole org's."""
    one = cli(node, "events", "--job", finished_job, "--json")
    assert one.returncode == 0, one.stderr
    events = [json.loads(line) for line in one.stdout.splitlines()]
    assert events[0]["type"] == "job.accepted" and events[-1]["type"] == "job.completed"
    assert {e["job_id"] for e in events} == {finished_job}
    steps = [e["data"]["step"] for e in events if e["type"] == "train.step"]
    assert steps == list(range(1, STEPS + 1))
    every = cli(node, "events")
    assert every.returncode == 0, every.stderr
    assert f"{finished_job} job.completed" in every.stdout
    assert {line.split()[1] for line in every.stdout.splitlines()} >= {finished_job}


async def test_an_event_stored_twice_is_read_once(node) -> None:
    """The learner publishes again what a broker outage left unacknowledged; when the first
    try was stored after all, the topic holds the record twice (CI saw a durable broker's
    SIGKILL do it). A job's events and an org's come each once all the same."""
    from rlnode.bus import Bus
    from rlnode.bus.signing import RecordSigner
    from rlnode.messages import JobEvent, JobEventType
    from rlnode.messages.jobs import CompletedData

    running, org, _config, _directory = node
    job_id = unique_id("twice")
    signer = RecordSigner(
        running.url("credential-vault"), running.service_token(["records:sign"], "learner")
    )
    started = JobEvent.of(job_id, org.org_id, "learner", JobEventType.STARTED, "started")
    done = JobEvent.of(
        job_id, org.org_id, "learner", JobEventType.COMPLETED, "done", CompletedData(steps=1)
    )
    async with Bus(running.kafka_settings(), service="learner", signer=signer) as bus:
        await bus.publish_all([started, started, done, done])
    async with running.jobs(org, "twice") as jobs:
        read = [e.id async for e in jobs.events(job_id, follow=False)]
        of_org = [e.id async for e in jobs.org_events(follow=False) if e.job_id == job_id]
    assert read == [started.id, done.id]
    assert of_org == [started.id, done.id]


def test_export_replays_a_job_into_tensorboard_mlflow_and_wandb(node, finished_job) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = node[3] / "tensorboard"
    exported = cli(node, "job", "export", finished_job, "--to", "tensorboard", "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    run = EventAccumulator(str(out / finished_job))
    run.Reload()
    assert [s.step for s in run.Scalars("train/reward_mean")] == list(range(1, STEPS + 1))
    assert [s.step for s in run.Scalars("eval/reward_mean")] == [0, 2, STEPS]
    # MLflow, in a SQLite database in a directory.
    from mlflow.tracking import MlflowClient

    from rlnode.trackers.mlflow import tracking_uri

    mlruns = node[3] / "mlruns"
    exported = cli(node, "job", "export", finished_job, "--to", "mlflow", "--out", str(mlruns))
    assert exported.returncode == 0, exported.stderr
    client = MlflowClient(tracking_uri(str(mlruns)))
    (run,) = client.search_runs([client.get_experiment_by_name("rlnode").experiment_id])
    assert run.info.run_name == finished_job and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/reward_mean")
    assert [m.step for m in history] == list(range(1, STEPS + 1))
    # W&B, offline.
    from tests.unit.test_trackers import read_wandb_history

    runs = node[3] / "wandb-runs"
    exported = cli(node, "job", "export", finished_job, "--to", "wandb", "--out", str(runs))
    assert exported.returncode == 0, exported.stderr
    rows = [row for row in read_wandb_history(runs) if "train/reward_mean" in row]
    assert [row["_step"] for row in rows] == list(range(1, STEPS + 1))
    # [logging]: the learner wrote the same steps as the job went, and closed the run with
    # the job's verdict.
    live = node[0].data_dir / "checkpoints" / node[1].org_id / finished_job / "trackers"
    board = EventAccumulator(str(live / "tensorboard" / finished_job))
    board.Reload()
    assert [s.step for s in board.Scalars("train/reward_mean")] == list(range(1, STEPS + 1))
    client = MlflowClient(tracking_uri(str(live / "mlflow")))
    (run,) = client.search_runs([client.get_experiment_by_name("rlnode").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/pass_at_k")] == [
        0,
        2,
        STEPS,
    ]
    unknown = cli(node, "job", "export", "job-nope", "--to", "tensorboard", "--out", str(out))
    assert unknown.returncode == 1 and "no events of job job-nope" in unknown.stderr


def test_eval_rounds_pick_the_best_checkpoint_and_any_checkpoint_evaluates_later(
    node, finished_job
) -> None:
    """[eval]: a round before training and after steps 2 and 4, each on its step's weights;
    `<job>@best` serves the checkpoint of the best; `rlnode job eval` runs any checkpoint
    on other seeds after the fact."""
    running, org, _config, _directory = node
    listed = cli(node, "events", "--job", finished_job, "--json")
    rounds = [json.loads(line) for line in listed.stdout.splitlines()]
    rounds = [e["data"] for e in rounds if e["type"] == "eval.completed"]
    assert [r["step"] for r in rounds] == [0, 2, STEPS]
    assert all(r["count"] + r["failed"] == 8 and r["pass_at_k"] is not None for r in rounds)
    assert all([s["seed"] for s in r["per_seed"]] == [1000, 1001, 1002, 1003] for r in rounds)
    with CheckpointClient(running.url("checkpoint-server"), org.token) as server:

        def all_three() -> list[dict] | None:
            found = server.evals(finished_job)
            return found if len(found) == 3 else None

        indexed = wait_until(all_three, 30, "the three rounds indexed")
        assert [r["reward_mean"] for r in indexed] == [r["reward_mean"] for r in rounds]
        checkpointed = [r for r in indexed if r["step"] in (2, STEPS)]  # no checkpoint of 0
        best = max(checkpointed, key=lambda r: (r["reward_mean"], r["step"]))["step"]
        assert server.job(finished_job)["best_checkpoint"] == best
        entry, state = server.checkpoint(f"{finished_job}@best")
        assert entry["step"] == state["step"] == best
        assert JobConfig.model_validate(state["job_config"]).eval is not None
        answer = server.chat(f"{finished_job}@best", "Copy: cab", max_tokens=4, temperature=0)
        assert answer["choices"][0]["message"]["content"] is not None
    status = cli(node, "job", "status", finished_job)
    assert f"best eval  step {best}" in status.stdout
    evaluated = cli(
        node, "job", "eval", f"{finished_job}@best", "--seeds", "2000:2003", "--samples", "2"
    )
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    assert "eval at step 0: reward" in evaluated.stdout and "job.completed" in evaluated.stdout
    table = [line.split() for line in evaluated.stdout.splitlines() if line[:10].strip()]
    assert [row[0] for row in table if row[0].isdigit()] == ["2000", "2001", "2002"]
    refused = cli(node, "job", "eval", f"{finished_job}@best", "--seeds", "5:5")
    assert refused.returncode == 1 and "STOP > START" in refused.stderr


async def test_the_openai_client_talks_to_latest_and_earlier_checkpoints(
    node, finished_job
) -> None:
    running, org, _config, _directory = node
    client = openai.AsyncOpenAI(
        base_url=running.url("checkpoint-server") + "/v1", api_key=org.token, max_retries=0
    )
    latest = await client.chat.completions.create(
        model=f"{finished_job}@latest",
        messages=[{"role": "user", "content": "Copy: abc"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
    )
    assert latest.choices[0].message.content is not None
    assert latest.usage.completion_tokens == len(latest.choices[0].logprobs.content) > 0
    earlier = await client.completions.create(
        model=f"{finished_job}@2", prompt="Copy: abc", max_tokens=5, temperature=0
    )
    assert earlier.choices[0].finish_reason in ("stop", "length")
    # Streaming: the chunks add up to the same greedy answer.
    stream = await client.chat.completions.create(
        model=f"{finished_job}@latest",
        messages=[{"role": "user", "content": "Copy: abc"}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    pieces = [c.choices[0].delta.content or "" async for c in stream]
    assert "".join(pieces) == latest.choices[0].message.content
    # Many at once: batched by the engine, each answered.
    answers = await asyncio.gather(
        *(
            client.chat.completions.create(
                model=f"{finished_job}@latest",
                messages=[{"role": "user", "content": f"Copy: {w}"}],
                max_tokens=4,
            )
            for w in ["abc", "cab", "bca", "aab"] * 4
        )
    )
    assert len(answers) == 16 and all(a.choices[0].finish_reason for a in answers)
    # An unknown model is a 404 that says what exists.
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(
            model=f"{finished_job}@99", messages=[{"role": "user", "content": "hi"}]
        )
    assert f"it has steps 2, {STEPS}" in str(missing.value)
    await client.close()


def test_served_logprobs_equal_a_forward_pass_of_the_saved_weights(node, finished_job) -> None:
    running, org, _config, _directory = node
    from transformers import AutoModelForCausalLM

    with CheckpointClient(running.url("checkpoint-server"), org.token) as server:
        answer = server.chat(
            f"{finished_job}@{STEPS}",
            "Copy: cab",
            max_tokens=6,
            temperature=0,
            logprobs=True,
        )
    served = [t["logprob"] for t in answer["choices"][0]["logprobs"]["content"]]
    path = (
        running.data_dir
        / "checkpoints"
        / org.org_id
        / finished_job
        / "checkpoints"
        / f"step-{STEPS:06d}"
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Copy: cab"}], add_generation_prompt=True, tokenize=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    completion = tokenizer.convert_tokens_to_ids(
        [t["token"] for t in answer["choices"][0]["logprobs"]["content"]]
    )
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
    direct = [float(logprobs[0, len(prompt) - 1 + i, token]) for i, token in enumerate(completion)]
    assert served == pytest.approx(direct, abs=1e-4)


def test_a_deleted_checkpoint_gives_a_clear_error_and_the_server_goes_on(
    node, finished_job
) -> None:
    running, org, _config, _directory = node
    import shutil

    path = (
        running.data_dir / "checkpoints" / org.org_id / finished_job / "checkpoints" / "step-000002"
    )
    shutil.rmtree(path)
    with CheckpointClient(running.url("checkpoint-server"), org.token) as server:
        with pytest.raises(CheckpointError) as gone:
            server.chat(f"{finished_job}@2", "Copy: abc", max_tokens=3)
        assert gone.value.status == 410 and "files are gone" in gone.value.message
        listed = {c["step"]: c["on_disk"] for c in server.checkpoints(finished_job)}
        assert listed == {2: False, STEPS: True}
        # ... and the others still answer.
        assert server.chat(f"{finished_job}@latest", "Copy: abc", max_tokens=3)["choices"]
    infer = cli(node, "infer", f"{finished_job}@2", "Copy: abc")
    assert infer.returncode == 1 and "files are gone" in infer.stderr


def test_other_orgs_and_bad_tokens_see_nothing(node, finished_job) -> None:
    running, _org, _config, _directory = node
    stranger = running.create_org(unique_id("stranger"))
    url = running.url("checkpoint-server")
    with CheckpointClient(url, stranger.token) as server:
        assert server.checkpoints(finished_job) == [] and server.models() == []
        with pytest.raises(CheckpointError) as hidden:
            server.chat(f"{finished_job}@latest", "Copy: abc")
        assert hidden.value.status == 404
        with pytest.raises(CheckpointError) as no_job:
            server.job(finished_job)
        assert no_job.value.status == 404
    for token in (None, "rln1.forged.token"):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        response = httpx.get(f"{url}/v1/models", headers=headers)
        assert response.status_code == 401


def test_cli_failures_are_one_line_a_user_can_act_on(node, tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nsource = "x"\n[task_app]\nname = "copy"\n[training]\nsteps = -1\n')
    result = cli(node, "job", "start", str(bad))
    assert result.returncode == 1 and "training.steps" in result.stderr
    assert cli(node, "job", "start", str(tmp_path / "nope.toml")).stderr.startswith(
        "rlnode: no config file"
    )
    unknown = cli(node, "job", "watch", unique_id("nope"), "--wait", "2")
    assert unknown.returncode == 1 and "no events of job" in unknown.stderr
    status = cli(node, "job", "status", unique_id("nope"))
    assert status.returncode == 1 and "no job" in status.stderr
    running = node[0]
    down = subprocess.run(
        [sys.executable, "-m", "rlnode.cli", "job", "watch", "x", "--wait", "2"],
        env={
            **os.environ,
            "RLNODE_TOKEN": node[1].token,
            "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
            "KAFKA_REQUEST_TIMEOUT_MS": "2000",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert down.returncode == 1 and "cannot reach Kafka at 127.0.0.1:1" in down.stderr
    assert len(down.stderr.strip().splitlines()) == 1, down.stderr
    assert running.processes  # the node is still up


ENDS = ("job.completed", "job.failed", "job.rejected")


def raw_start_request(node, job_id: str) -> dict:
    """A one-step job's start request as any client writes it: JSON, with the job token
    straight from the vault's HTTP API."""
    running, org, config, _directory = node
    body = json.loads(config.read_text())
    body["training"]["steps"] = 1
    minted = httpx.post(
        f"{running.url('credential-vault')}/v1/orgs/{org.org_id}/job-tokens",
        json={"job_id": job_id},
        headers={"Authorization": f"Bearer {org.token}"},
    )
    minted.raise_for_status()
    return {
        "schema": "rlnode.JobRequest/1",
        "job_id": job_id,
        "org_id": org.org_id,
        "token": minted.json()["token"],
        "action": "start",
        "config": body,
    }


async def test_any_kafka_client_can_drive_a_job(node, org_login) -> None:
    """A plain aiokafka producer and consumer with the org's own login: raw JSON in, raw JSON
    out of the org's events topic, in a consumer group named as the org's may be."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    running, org, _config, _directory = node
    job_id = unique_id("raw")
    request = await asyncio.to_thread(raw_start_request, node, job_id)
    login = connection(KafkaSettings.from_exports(org_login["env"]))
    producer = AIOKafkaProducer(**login)
    await producer.start()
    await producer.send_and_wait(
        topics.JOB_REQUESTS, json.dumps(request).encode(), key=job_id.encode()
    )
    await producer.stop()
    consumer = AIOKafkaConsumer(
        org_login["events_topic"],
        **login,
        group_id=org_login["group_prefix"] + unique_id("raw"),
        auto_offset_reset="earliest",
    )
    await consumer.start()
    seen = []
    try:
        async with waiting_for(f"end of job {job_id} on the raw topic", 300, lambda: seen):
            async for record in consumer:
                if record.key != job_id.encode():  # records are keyed by job id
                    continue
                event = json.loads(record.value)
                if event["job_id"] == job_id:
                    seen.append(event["type"])
                    if event["type"] in ENDS:
                        break
    finally:
        await consumer.stop()
    assert seen[0] == "job.accepted" and seen[-1] == "job.completed", seen
    async with running.jobs(org) as jobs:
        replay = [e.type.value async for e in jobs.events(job_id, follow=False)]
    assert replay[0] == "job.accepted" and "job.completed" in replay


def test_confluent_kafka_drives_a_job(node, org_login) -> None:
    """librdkafka's client (confluent-kafka; kcat and most non-Python clients are built on
    it) with the org's own login starts a job and reads its events."""
    from confluent_kafka import Consumer, Producer

    job_id = unique_id("confluent")
    login = confluent_config(KafkaSettings.from_exports(org_login["env"]))
    producer = Producer(login)
    producer.produce(
        topics.JOB_REQUESTS, json.dumps(raw_start_request(node, job_id)).encode(), job_id
    )
    assert producer.flush(30) == 0, "the request was not delivered"
    consumer = Consumer(
        login
        | {
            "group.id": org_login["group_prefix"] + unique_id("confluent"),
            "auto.offset.reset": "earliest",
            "session.timeout.ms": 6000,
        }
    )
    consumer.subscribe([org_login["events_topic"]])
    seen: list[str] = []
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and not (seen and seen[-1] in ENDS):
            message = consumer.poll(1.0)
            if message is None or message.error() or message.key() != job_id.encode():
                continue
            event = json.loads(message.value())
            seen.append(event["type"])
    finally:
        consumer.close()
    assert seen and seen[0] == "job.accepted" and seen[-1] == "job.completed", seen


def test_kafka_credentials_are_refused_for_an_org_the_vault_does_not_know(node) -> None:
    running = node[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAFKA_")}
    refused = run_rlnode(
        env | {"RLNODE_DATA_DIR": str(running.data_dir)}, "kafka-credentials", "no-such-org"
    )
    assert refused.returncode == 2 and "org no-such-org" in refused.stderr, refused.stderr
    assert "org-no-such-org" not in (running.data_dir / "secrets/kafka/users.json").read_text()


def test_a_tool_calling_task_trains_through_the_node_and_its_checkpoint_calls_tools(
    node, tool_model, finished_job
) -> None:
    """OpenAI tool calls end to end: the calculator Task App (managed) offers `tools` on the
    generator's per-rollout endpoint; the calls the model writes come back to it as
    `tool_calls`, their results go in as `tool` messages over several turns, and the
    trajectories hold them in the turns' prompts; then the official `openai` client calls
    tools on the checkpoint it made."""
    running, org, _config, directory = node
    assert running.register_example_task_app(org, "calculator", "calculator")["ok"]
    job = example_job(
        "copy_task",
        tool_model,
        steps=2,
        prompts_per_step=2,
        group_size=4,
        checkpoint_every=2,
        # Small steps: the checkpoint must still call tools below (at the copy task's 3e-3,
        # two steps can undo the toy's fine-tuning, as one CI run saw).
        optimizer={"lr": 1e-5},
    )
    job = JobConfig.model_validate(
        job.model_dump(mode="json")
        | {
            "task_app": {"name": "calculator", "env_config": {"max_turns": 3}},
            "sampling": {"max_tokens": 96, "temperature": 1.0},
        }
    )
    config = directory / "calculator.json"
    config.write_text(job.model_dump_json())
    job_id = unique_id("tools")
    started = cli(node, "job", "start", str(config), "--job-id", job_id, "--watch")
    assert started.returncode == 0, started.stdout + started.stderr

    async def trajectories() -> list[Trajectory]:
        found: list[Trajectory] = []
        settings = running.kafka_settings()
        async with TopicReader(settings, topics.TRAJECTORIES, service="test", key=job_id) as reader:
            while not reader.caught_up.is_set():
                for record in await reader.fetch():
                    if record.key == job_id.encode():
                        found.append(decode(record.value, Trajectory))
        return found

    tokenizer = load_tokenizer(tool_model)
    several = [t for t in asyncio.run(trajectories()) if len(t.turns) >= 2]
    assert several, "no rollout went past its first turn"
    for trajectory in several:
        before, after = trajectory.turns[0], trajectory.turns[1]
        _content, calls = parse_tool_calls(tokenizer.decode(before.completion_ids, True))
        assert calls and "<tool_response>" in tokenizer.decode(after.prompt_ids)
        assert after.prompt_ids[: len(before.prompt_ids)] == before.prompt_ids

    with CheckpointClient(running.url("checkpoint-server"), org.token) as server:
        wait_indexed(server, job_id, [2])
    client = openai.OpenAI(
        base_url=running.url("checkpoint-server") + "/v1", api_key=org.token, max_retries=0
    )
    asked = [
        {"role": "system", "content": "Use the calculator tool, then give the final number."},
        {"role": "user", "content": "What is 12 + 30 - 5?"},
    ]
    # Sampled 8 times: the model calls the tool in most samples (15 of 16 before training).
    reply = client.chat.completions.create(
        model=f"{job_id}@latest",
        messages=asked,
        tools=calculator.TOOLS,
        max_tokens=96,
        temperature=1.0,
        n=8,
    )
    called = [c for c in reply.choices if c.finish_reason == "tool_calls"]
    assert called, [c.message.content for c in reply.choices]
    choice = called[0]
    call = choice.message.tool_calls[0]
    assert call.function.name == "calculator" and json.loads(call.function.arguments)
    # The call and its result go back in; the server renders them and answers.
    answered = client.chat.completions.create(
        model=f"{job_id}@latest",
        messages=[
            *asked,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "37"},
        ],
        tools=calculator.TOOLS,
        max_tokens=96,
        temperature=0,
    )
    assert answered.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError, match="constrained sampling"):
        client.chat.completions.create(
            model=f"{job_id}@latest", messages=asked, tools=calculator.TOOLS, tool_choice="required"
        )
    # A model whose template cannot show tools says so rather than dropping them.
    with pytest.raises(openai.BadRequestError, match="does not render tools"):
        client.chat.completions.create(
            model=f"{finished_job}@latest", messages=asked, tools=calculator.TOOLS
        )
    client.close()


def test_a_lora_job_syncs_adapters_and_its_checkpoints_are_served_merged(
    node, finished_job, tmp_path
) -> None:
    """[training.lora] through the whole node: weight versions and checkpoints hold the
    adapters alone; the checkpoint-server serves base + adapters with the logprobs of that
    merge, and hands out the merged weights."""
    running, org, config, _directory = node
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    job = JobConfig.model_validate_json(config.read_text())
    lora = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    document = job.model_dump(mode="json")
    document["training"] |= {
        "steps": 2,
        "checkpoint_every": 2,
        "optimizer": {"lr": 5e-2},
        "lora": lora,
    }
    document["eval"] = None
    document["logging"] = None
    lora_config = tmp_path / "lora.json"
    lora_config.write_text(json.dumps(document))
    job_id = unique_id("lora")
    result = cli(node, "job", "start", str(lora_config), "--job-id", job_id, "--watch")
    assert result.returncode == 0, result.stdout + result.stderr
    events = cli(node, "events", "--job", job_id, "--json")
    published = [
        json.loads(line)["data"]
        for line in events.stdout.splitlines()
        if json.loads(line)["type"] == "weights.published"
    ]
    base = job.model.source
    full_bytes = sum(f.stat().st_size for f in Path(base).glob("*.safetensors"))
    assert published and all(p["size_bytes"] < full_bytes / 10 for p in published)
    step_dir = (
        running.data_dir / "checkpoints" / org.org_id / job_id / "checkpoints" / "step-000002"
    )
    names = {f.name for f in step_dir.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
    assert "model.safetensors" not in names  # the base is referenced, not copied
    assert (
        json.loads((step_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
        == base
    )
    with CheckpointClient(running.url("checkpoint-server"), org.token) as server:
        wait_indexed(server, job_id, [2])
        merged_file = server.download_merged(f"{job_id}@2", tmp_path / "merged.safetensors")
        answer = server.chat(f"{job_id}@2", "Copy: cab", max_tokens=6, temperature=0, logprobs=True)
        with pytest.raises(CheckpointError) as whole:  # a full-weight checkpoint has no merge
            server.download_merged(f"{finished_job}@{STEPS}", tmp_path / "x")
    assert whole.value.status == 400 and "holds whole weights" in whole.value.message
    # The merged weights: the base with q and v projections changed, nothing else.
    merged = load_file(str(merged_file))
    original = load_file(str(next(Path(base).glob("*.safetensors"))))
    changed = {k for k in original if not torch.equal(original[k], merged[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed)
    # Served = a forward pass of the merged weights.
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model.load_state_dict(merged, strict=False)
    tokenizer = load_tokenizer(base)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Copy: cab"}], add_generation_prompt=True, tokenize=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    content = answer["choices"][0]["logprobs"]["content"]
    completion = tokenizer.convert_tokens_to_ids([t["token"] for t in content])
    with torch.no_grad():
        logprobs = torch.log_softmax(
            model(input_ids=torch.tensor([prompt + completion])).logits.float(), dim=-1
        )
    direct = [float(logprobs[0, len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]
    assert [t["logprob"] for t in content] == pytest.approx(direct, abs=1e-4)
