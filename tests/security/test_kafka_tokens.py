"""An attacker who can read Kafka (here with the admin's login, which reads every topic)
looks for tokens: in job requests, in dead letters, in the services' logs; and replays the
job token a request carried."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import uuid

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from rlnode.bus import KafkaSettings
from rlnode.bus.clients import connection
from rlnode.examples import example_job
from rlnode.messages import topics
from rlnode.service.auth import read_unverified
from rlnode.testing import unique_id
from tests.security.conftest import AttackedNode

# What an attacker greps for: anything shaped like an rlnode token.
TOKEN_PATTERN = re.compile(r"rln1\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")


async def read_all(settings: KafkaSettings, topic: str) -> list[bytes]:
    consumer = AIOKafkaConsumer(topic, **connection(settings), auto_offset_reset="earliest")
    await consumer.start()
    try:
        records = await consumer.getmany(timeout_ms=3000)
        values = [r.value or b"" for batch in records.values() for r in batch]
        while batch := await consumer.getmany(timeout_ms=1000):
            values += [r.value or b"" for b in batch.values() for r in b]
        return values
    finally:
        await consumer.stop()


async def publish_raw(settings: KafkaSettings, key: str, value: bytes) -> None:
    producer = AIOKafkaProducer(**connection(settings))
    await producer.start()
    try:
        await producer.send_and_wait(topics.JOB_REQUESTS, value, key=key.encode())
    finally:
        await producer.stop()


async def rejection(settings: KafkaSettings, job_id: str, within_s: float = 90) -> dict:
    """The newest job.rejected event of `job_id`, once there is one (read raw: a job that
    completed already gets it after its end)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        events = [json.loads(v) for v in await read_all(settings, topics.JOB_EVENTS)]
        rejected = [e for e in events if e["job_id"] == job_id and e["type"] == "job.rejected"]
        if rejected:
            return rejected[-1]
        assert asyncio.get_running_loop().time() < deadline, f"no job.rejected for {job_id}"
        await asyncio.sleep(1)


async def test_no_org_token_on_kafka_and_a_job_token_works_once(attacked: AttackedNode) -> None:
    settings = attacked.node.kafka_settings()
    org_tokens = {attacked.attacker.token, attacked.victim.token}
    # A user who puts the org token in a request by hand, and garbage hiding tokens in
    # fields the schema does not know.
    careless = unique_id("careless")
    request = {
        "schema": "rlnode.JobRequest/1",
        "id": str(uuid.uuid4()),
        "job_id": careless,
        "org_id": attacked.attacker.org_id,
        "token": attacked.attacker.token,
        "action": "cancel",
    }
    await publish_raw(settings, careless, json.dumps(request).encode())
    garbage = {**request, "job_id": unique_id("garbage"), "action": "explode"}
    garbage["note"] = {"deep": [attacked.attacker.token]}
    await publish_raw(settings, garbage["job_id"], json.dumps(garbage).encode())
    refused = await rejection(settings, careless)
    assert "job requests carry a job token" in refused["message"]

    requests = await read_all(settings, topics.JOB_REQUESTS)
    # The victim's start request: by its job id (other requests may name that id elsewhere,
    # e.g. a model.source under the victim's checkpoints).
    parsed = [json.loads(v) for v in requests if attacked.victim_job.encode() in v]
    victim_request = next(r for r in parsed if r.get("job_id") == attacked.victim_job)
    carried = read_unverified(victim_request["token"])
    assert carried["kind"] == "job" and carried["job"] == attacked.victim_job
    # Apart from the two records this test put there by hand, no org token on the topic.
    ours = (careless.encode(), garbage["job_id"].encode())
    others = [v for v in requests if not any(job in v for job in ours)]
    assert not any(t.encode() in v for v in others for t in org_tokens)

    # Dead letters and logs: no token of any kind, whatever field it hid in.
    letters = await read_all(settings, topics.DEAD_LETTERS)
    assert any(garbage["job_id"].encode() in v for v in letters)
    for letter in letters:
        payload = json.loads(letter)
        inner = base64.b64decode(payload.get("payload_b64", "")).decode(errors="replace")
        assert not TOKEN_PATTERN.search(inner), inner[:300]
        assert not TOKEN_PATTERN.search(letter.decode(errors="replace"))
    for log in (attacked.node.data_dir / "logs").glob("*.log"):
        text = log.read_text(errors="replace")
        found = [t for t in TOKEN_PATTERN.findall(text)]
        assert not found, (log.name, found[:3])

    # The victim's job token, read off the topic: replayed as it was, and for another job.
    replay = dict(victim_request, id=str(uuid.uuid4()))
    await publish_raw(settings, attacked.victim_job, json.dumps(replay).encode())
    other = unique_id("stolen")
    job = example_job("copy_task", attacked.model, steps=1)
    stolen = dict(replay, id=str(uuid.uuid4()), job_id=other, config=job.model_dump(mode="json"))
    stolen["action"] = "start"
    await publish_raw(settings, other, json.dumps(stolen).encode())
    assert f"is for job {attacked.victim_job!r}" in (await rejection(settings, other))["message"]
    assert "used already" in (await rejection(settings, attacked.victim_job))["message"]
