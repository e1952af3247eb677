"""An org asks for more than a job may cost, or for a model it may not read: another org's
checkpoint as model.source, a job a thousand times too large. Each is rejected naming why,
and the learner stays up for everyone else."""

from __future__ import annotations

import httpx

from rlnode.examples import example_job
from rlnode.messages import JobEventType
from rlnode.sdk.checkpoints import CheckpointClient
from tests.security.conftest import AttackedNode


async def verdict(attacked: AttackedNode, config) -> tuple[JobEventType, str]:
    async with attacked.node.jobs(attacked.attacker) as jobs:
        job = await jobs.start(config)
        async for event in jobs.events(job, idle_timeout_s=120):
            if event.type in (JobEventType.ACCEPTED, JobEventType.REJECTED):
                if event.type is JobEventType.ACCEPTED:
                    await jobs.cancel(job)
                return event.type, event.data.get("reason", event.message)
    raise AssertionError("no verdict")


async def test_another_orgs_checkpoint_is_no_model_source(attacked: AttackedNode) -> None:
    with CheckpointClient(attacked.url("checkpoint-server"), attacked.victim.token) as client:
        uri = client.checkpoints(attacked.victim_job)[-1]["uri"]
    theirs = uri.removeprefix("file://")
    config = example_job("copy_task", theirs, steps=1)
    kind, reason = await verdict(attacked, config)
    assert kind is JobEventType.REJECTED, reason
    assert "node's own data" in reason
    # The same through a path that climbs out of a directory the node allows.
    store = attacked.node.data_dir / "checkpoints"
    sideways = store / attacked.attacker.org_id / "x" / ".." / ".." / attacked.victim.org_id
    kind, reason = await verdict(attacked, example_job("copy_task", str(sideways), steps=1))
    assert kind is JobEventType.REJECTED, reason


async def test_an_oversized_job_is_rejected_naming_the_limit_and_the_learner_stays_up(
    attacked: AttackedNode,
) -> None:
    huge = example_job("copy_task", attacked.model, prompts_per_step=65_536, group_size=1_024)
    kind, reason = await verdict(attacked, huge)
    assert kind is JobEventType.REJECTED
    assert "LEARNER_MAX_ROLLOUTS_PER_STEP" in reason and "67108864" in reason
    long = example_job("copy_task", attacked.model, steps=10_000_000)
    kind, reason = await verdict(attacked, long)
    assert kind is JobEventType.REJECTED and "LEARNER_MAX_STEPS" in reason
    async with httpx.AsyncClient() as http:
        health = await http.get(f"{attacked.url('learner')}/health")
    assert health.json()["status"] == "ok"


async def test_a_file_that_is_not_a_whole_gguf_is_no_model_source(
    attacked: AttackedNode, tmp_path_factory
) -> None:
    """In a directory the node loads models from: a text file, and a file that starts like a
    GGUF and then is not one. Both are refused at intake, naming the problem."""
    allowed = tmp_path_factory.mktemp("models-allowed-by-rlnode-up")
    text = allowed / "notes.txt"
    text.write_text("not a model\n")
    kind, reason = await verdict(attacked, example_job("copy_task", str(text), steps=1))
    assert kind is JobEventType.REJECTED and "is a file that is not GGUF" in reason, reason
    forged = allowed / "model.gguf"
    forged.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    kind, reason = await verdict(attacked, example_job("copy_task", str(forged), steps=1))
    assert kind is JobEventType.REJECTED and "could not be read as GGUF" in reason, reason
    async with httpx.AsyncClient() as http:
        health = await http.get(f"{attacked.url('learner')}/health")
    assert health.json()["status"] == "ok"
