"""`rlnode doctor`: exercise the node's plumbing end to end on whatever it is configured
with (embedded defaults when nothing is): broker, topics, every message type through the
bus, dead letters, the database, and every service process."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from aiokafka import AIOKafkaProducer
from sqlalchemy import text

from rlnode.bus import Bus, ensure_topics
from rlnode.bus.clients import connection
from rlnode.bus.localbroker import free_port
from rlnode.bus.settings import KafkaSettings
from rlnode.messages import topics
from rlnode.messages.examples import example_payloads
from rlnode.node.processes import ServiceProcess, ensure_local_credentials
from rlnode.service.db import engine_for, redacted_url
from rlnode.service.registry import SERVICES
from rlnode.service.settings import DatabaseSettings, NodeSettings


@dataclass
class CheckResult:
    name: str
    ok: bool
    seconds: float
    detail: str


def _check(name: str, fn: Callable[[], str]) -> CheckResult:
    start = time.monotonic()
    try:
        detail = fn()
        ok = True
    except Exception as e:
        detail, ok = f"{type(e).__name__}: {e}", False
    return CheckResult(name, ok, time.monotonic() - start, detail)


def run_checks(kafka: KafkaSettings, node: NodeSettings) -> list[CheckResult]:
    results = [
        _check("topics", lambda: _topics(kafka)),
        _check("bus round trip", lambda: asyncio.run(_round_trip(kafka))),
        _check("dead letters", lambda: asyncio.run(_dead_letter(kafka))),
        _check("database", lambda: _database(node)),
    ]
    # Each service in a process of its own, all at once: most of a start is waiting (on the
    # broker's group joins), and one after the other they took ~40 s on two cores.
    with ThreadPoolExecutor(len(SERVICES)) as pool:
        checks = [
            pool.submit(_check, f"service {spec.name}", partial(_service, spec, node, kafka))
            for spec in SERVICES
        ]
        results.extend(check.result() for check in checks)
    return results


def _topics(kafka: KafkaSettings) -> str:
    created = asyncio.run(ensure_topics(kafka))
    return f"{len(topics.ALL_TOPICS)} topics ({len(created)} created, {kafka.partitions} partitions each)"


async def _round_trip(kafka: KafkaSettings) -> str:
    job_id = f"doctor-{uuid.uuid4().hex[:8]}"
    sent = example_payloads(job_id, "doctor")
    pending = {m.id: m for m in sent}
    done = asyncio.Event()
    bus = Bus(kafka, service="doctor")

    async def receive(message, _delivery) -> None:
        expected = pending.get(message.id)
        if expected is not None:
            if message != expected:
                raise AssertionError(f"{type(message).__name__} changed on the way: {message!r}")
            del pending[message.id]
            if not pending:
                done.set()

    for topic in topics.ALL_TOPICS:
        bus.subscribe(topic, receive, group_id=None)
    async with bus:
        start = time.monotonic()
        for message in sent:
            await bus.publish(message)
        try:
            await asyncio.wait_for(done.wait(), 30)
        except TimeoutError:
            missing = sorted({type(m).__name__ for m in pending.values()})
            raise AssertionError(f"not received within 30s: {', '.join(missing)}") from None
        took = time.monotonic() - start
    return f"{len(sent)} records of {len(topics.ALL_TOPICS)} types published and read back equal in {took * 1000:.0f} ms"


async def _dead_letter(kafka: KafkaSettings) -> str:
    key = f"doctor-{uuid.uuid4().hex[:8]}"
    got = asyncio.Event()
    bus = Bus(kafka, service="doctor")

    async def ignore(_message, _delivery) -> None:
        pass

    async def letter(message, _delivery) -> None:
        if message.key == key and message.error == "decode":
            got.set()

    # Dead-lettering is the work of a topic's consumer group: a new group, reading from now.
    events = bus.subscribe(topics.JOB_EVENTS, ignore, group_id=key, from_beginning=False)
    bus.subscribe(topics.DEAD_LETTERS, letter, group_id=None, from_beginning=False)
    bus_log = logging.getLogger("rlnode.bus")
    level = bus_log.level
    bus_log.setLevel(logging.ERROR)  # the dead-letter warning is what this check provokes
    async with bus:
        await events.wait_assigned()
        producer = AIOKafkaProducer(**connection(kafka))
        await producer.start()
        try:
            await producer.send_and_wait(topics.JOB_EVENTS, b"not json", key=key.encode())
        finally:
            await producer.stop()
        await asyncio.wait_for(got.wait(), 30)
    bus_log.setLevel(level)
    return "a malformed record went to rlnode.dead-letters with its reason"


def _database(node: NodeSettings) -> str:
    settings = DatabaseSettings()
    engine = engine_for("doctor", settings, node)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()
    return redacted_url(settings.url_for("doctor", node))


def _service(spec, node: NodeSettings, kafka: KafkaSettings) -> str:
    env = kafka.connection_env() | {"RLNODE_DATA_DIR": str(node.data_dir)}
    if spec.name == "credential-vault":
        env |= ensure_local_credentials(node.data_dir).vault_env()
    service = ServiceProcess(
        spec, free_port(), node.data_dir / "logs" / f"{spec.name}.log", env=env
    ).start()
    try:
        health = service.wait_healthy()
    finally:
        code = service.stop()
    if code != 0:
        raise RuntimeError(
            f"exited with {code} on SIGTERM; log {service.log_path}, its end:\n"
            + service.log_tail(4000)
        )
    said = f"healthy (pid {health['pid']}), stopped cleanly on SIGTERM"
    network = health.get("info", {}).get("taskapp_network")
    if network is not None:  # the gateway: which network its managed Task Apps get
        if not network["ready"]:
            raise RuntimeError(network["detail"])
        said += f"; managed Task Apps' network: {describe_network(network)}"
    return said


def describe_network(network: dict) -> str:
    if network["mode"] == "open":
        return f"OPEN ({network['detail']})"
    allowed = ", ".join(["the generators' rollout endpoints", *network.get("allow_to", [])])
    return f"isolated by nftables ({network['table']}): they reach {allowed}"
