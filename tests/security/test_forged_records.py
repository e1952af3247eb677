"""An attacker with a Kafka client forges what the services publish: a checkpoint.saved that
re-points the victim's job, weight versions that name /etc/passwd or the victim's files, a
job.completed for a running job, trajectories with made-up rewards. Each changes nothing and
lands in dead letters; a service's own signed record naming another org's files is refused
too."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from pathlib import Path

import httpx
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from rlnode.bus import KafkaSettings
from rlnode.bus.clients import connection
from rlnode.examples import example_job
from rlnode.messages import JobEvent, JobEventType, Trajectory, WeightVersion, topics
from rlnode.messages.codec import encode
from rlnode.messages.examples import example_payloads
from rlnode.messages.jobs import CheckpointSavedData, CompletedData
from rlnode.sdk.checkpoints import CheckpointClient, CheckpointError
from rlnode.testing import unique_id
from tests.security.conftest import AttackedNode


async def forge(settings: KafkaSettings, *records) -> None:
    """Publish as someone who may write the topics (the admin's login, which no ACL stops:
    the worst case), with no signature (or a made-up one)."""
    producer = AIOKafkaProducer(**connection(settings))
    await producer.start()
    try:
        for topic, record in records:
            headers = [("rlnode-cert", b"rlc1.e30.AAAA"), ("rlnode-sig", b"\0" * 64)]
            await producer.send_and_wait(
                topic, encode(record), key=record.job_id.encode(), headers=headers
            )
    finally:
        await producer.stop()


async def dead_letters_of(
    settings: KafkaSettings, record_ids: set[str], within_s: float = 60
) -> dict:
    """{forged record id: the dead letter's reason}, once every one has a dead letter."""
    found: dict[str, str] = {}
    deadline = asyncio.get_running_loop().time() + within_s
    consumer = AIOKafkaConsumer(
        topics.DEAD_LETTERS, **connection(settings), auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        while set(found) != record_ids:
            assert asyncio.get_running_loop().time() < deadline, (record_ids - set(found), found)
            batches = await consumer.getmany(timeout_ms=1000)
            for record in (r for batch in batches.values() for r in batch):
                letter = json.loads(record.value)
                inner = base64.b64decode(letter["payload_b64"]).decode(errors="replace")
                for record_id in record_ids:
                    if record_id in inner:
                        found[record_id] = letter["reason"]
        return found
    finally:
        await consumer.stop()


async def test_forged_checkpoint_and_weight_records_change_nothing(attacked: AttackedNode) -> None:
    node, victim, job = attacked.node, attacked.victim, attacked.victim_job
    with CheckpointClient(node.url("checkpoint-server"), victim.token) as client:
        before = sorted((c["step"], c["uri"]) for c in client.checkpoints(job))
    assert len(before) >= 2
    hijack = JobEvent.of(
        job,
        victim.org_id,
        "learner",
        JobEventType.CHECKPOINT_SAVED,
        "checkpoint at step 2",
        CheckpointSavedData(step=2, uri=before[0][1], final=True),
    )
    extra = JobEvent.of(
        job,
        victim.org_id,
        "learner",
        JobEventType.CHECKPOINT_SAVED,
        "checkpoint at step 9",
        CheckpointSavedData(step=9, uri=Path("/etc").as_uri()),
    )
    template = next(p for p in example_payloads(job, victim.org_id) if isinstance(p, WeightVersion))
    passwd = template.model_copy(update={"uri": "file:///etc/passwd", "version": 99})
    foreign = template.model_copy(
        update={
            "job_id": unique_id("mine"),
            "org_id": attacked.attacker.org_id,
            "uri": before[1][1] + "/model.safetensors",
            "version": 98,
        }
    )
    await forge(
        node.kafka_settings(),
        (topics.JOB_EVENTS, hijack),
        (topics.JOB_EVENTS, extra),
        (topics.WEIGHT_VERSIONS, passwd),
        (topics.WEIGHT_VERSIONS, foreign),
    )
    reasons = await dead_letters_of(
        node.kafka_settings(), {str(r.id) for r in (hijack, extra, passwd, foreign)}
    )
    assert all("certificate" in r or "unsigned" in r for r in reasons.values()), reasons
    with CheckpointClient(node.url("checkpoint-server"), victim.token) as client:
        assert sorted((c["step"], c["uri"]) for c in client.checkpoints(job)) == before
        assert client.job(job)["status"] == "completed"
    # Nothing about /etc/passwd reached any job's events.
    async with node.jobs(victim) as jobs:
        events = await jobs.history(job)
    assert not any("passwd" in e.message for e in events)


async def test_a_running_job_ignores_a_forged_end_and_forged_trajectories(
    attacked: AttackedNode,
) -> None:
    node, victim = attacked.node, attacked.victim
    config = example_job("copy_task", attacked.model, steps=4, group_size=4, prompts_per_step=2)
    async with node.jobs(victim) as jobs:
        job = await jobs.start(config)
        async for event in jobs.events(job, idle_timeout_s=120):
            if event.type is JobEventType.STARTED:
                break
        end = JobEvent.of(
            job,
            victim.org_id,
            "learner",
            JobEventType.COMPLETED,
            "done (forged)",
            CompletedData(steps=4),
        )
        fakes = [
            p.model_copy(update={"id": uuid.uuid4(), "step": step, "reward": 1.0})
            for p in example_payloads(job, victim.org_id)
            if isinstance(p, Trajectory) and p.status == "ok"
            for step in range(4)
        ]
        await forge(
            node.kafka_settings(),
            (topics.JOB_EVENTS, end),
            *((topics.TRAJECTORIES, f) for f in fakes),
        )
        seen = []
        async with asyncio.timeout(300):
            async for event in jobs.events(job, idle_timeout_s=120):
                seen.append(event)
    final = seen[-1]
    assert final.type is JobEventType.COMPLETED and final.message != "done (forged)"
    steps = [e.data["step"] for e in seen if e.type is JobEventType.TRAIN_STEP]
    assert steps[-1] == 4
    reasons = await dead_letters_of(node.kafka_settings(), {str(r.id) for r in [end, *fakes]})
    assert len(reasons) == 1 + len(fakes)


async def test_a_services_own_record_naming_another_orgs_files_is_refused(
    attacked: AttackedNode,
) -> None:
    """Even signed by the learner's key: a checkpoint.saved of the attacker's job that points
    at the victim's checkpoint is not indexed, so the attacker cannot serve or download it."""
    node = attacked.node
    with CheckpointClient(node.url("checkpoint-server"), attacked.victim.token) as client:
        victim_uri = client.checkpoints(attacked.victim_job)[-1]["uri"]
    from rlnode.bus import Bus
    from rlnode.bus.signing import RecordSigner

    learner = RecordSigner(
        node.url("credential-vault"), node.service_token(["records:sign"], "learner")
    )
    mine = unique_id("mine")
    pointing = JobEvent.of(
        mine,
        attacked.attacker.org_id,
        "learner",
        JobEventType.CHECKPOINT_SAVED,
        "checkpoint at step 1",
        CheckpointSavedData(step=1, uri=victim_uri),
    )
    async with Bus(node.kafka_settings(), service="learner", signer=learner) as bus:
        await bus.publish(pointing)
    with CheckpointClient(node.url("checkpoint-server"), attacked.attacker.token) as client:
        # The index has read the record once the job it names has a summary (made from the
        # same event, after the checkpoint part).
        deadline = asyncio.get_running_loop().time() + 60
        while True:
            try:
                client.job(mine)
                break
            except CheckpointError:
                assert asyncio.get_running_loop().time() < deadline, "the index never read it"
                await asyncio.sleep(0.2)
        assert client.checkpoints(mine) == []
    async with httpx.AsyncClient(base_url=node.url("checkpoint-server"), timeout=30) as http:
        served = await http.post(
            "/v1/completions",
            json={"model": f"{mine}@1", "prompt": "Copy: ab", "max_tokens": 2},
            headers={"Authorization": f"Bearer {attacked.attacker.token}"},
        )
    assert served.status_code == 404, served.text
