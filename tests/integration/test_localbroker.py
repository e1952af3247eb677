"""The node's Apache Kafka as a process: it says clearly what is wrong when it cannot start;
killed with SIGKILL and started again on its directory it has every record and committed
offset; and a node started again on its data dir finds its topics, users and ACLs."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from rlnode.bus import KafkaSettings, TopicReader, clients, ensure_topics
from rlnode.bus.acls import granted_sync
from rlnode.bus.localbroker import BrokerBinaryMissing, BrokerStartError, LocalBroker
from rlnode.bus.pki import NodeCA
from rlnode.bus.principals import ADMIN, BROKER_CERT_NAME, KafkaUser
from rlnode.messages import topics


def test_missing_jars_are_a_clear_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("RLNODE_KAFKA_LIBS", str(tmp_path / "no-jars"))
    with pytest.raises(BrokerBinaryMissing, match=r"no Apache Kafka jars in .*make setup"):
        LocalBroker(tmp_path / "kafka").start()


def test_a_broker_that_cannot_listen_is_reported_with_its_log(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BrokerStartError, match=r"exited with code(.|\n)*broker log"):
            LocalBroker(tmp_path / "kafka", port=port, start_timeout_s=60).start()


def test_a_cluster_id_and_password_starting_with_a_dash_format(tmp_path) -> None:
    """One base64 cluster id in 64 starts with "-" (read as an option if passed apart from
    its option: a format failed so once)."""
    identity = NodeCA.ensure(tmp_path / "ca").write_identity(
        tmp_path / "b", BROKER_CERT_NAME, ("127.0.0.1",)
    )
    broker = LocalBroker(
        tmp_path / "kafka",
        identity,
        KafkaUser(ADMIN, "-starts-with-a-dash"),
        cluster_id="-abcdefghijklmnopqrstu",
    )
    broker._write_config()
    broker.format()
    meta = (broker.data_dir / "meta.properties").read_text()
    assert "cluster.id=-abcdefghijklmnopqrstu" in meta


async def _produce(settings: KafkaSettings, topic: str, values: range) -> None:
    producer = clients.producer(settings, "test")
    await producer.start()
    try:
        for i in values:
            await producer.send_and_wait(topic, f"r{i}".encode(), key=b"job")
    finally:
        await producer.stop()


async def _read(consumer: AIOKafkaConsumer, count: int) -> list[str]:
    got: list[str] = []
    while len(got) < count:
        records = await asyncio.wait_for(consumer.getmany(timeout_ms=1000), 30)
        got += [r.value.decode() for batch in records.values() for r in batch]
    return got


def test_a_broker_killed_keeps_every_record_and_committed_offset(tmp_path) -> None:
    broker = LocalBroker(tmp_path / "kafka")
    partition = TopicPartition("durable", 0)

    def settings() -> KafkaSettings:
        return KafkaSettings(
            bootstrap_servers=broker.bootstrap_servers,
            session_timeout_ms=6000,
            heartbeat_interval_ms=2000,
        )

    async def before() -> None:
        await ensure_topics(settings(), ["durable"], partitions=1)
        await _produce(settings(), "durable", range(20))
        consumer = clients.consumer(settings(), "test", group_id="g")
        await consumer.start()
        consumer.subscribe(["durable"])
        try:
            assert len(await _read(consumer, 20)) == 20
            await consumer.commit({partition: 12})
        finally:
            await consumer.stop()

    async def after() -> tuple[int | None, list[str]]:
        consumer = clients.consumer(settings(), "test", group_id="g")
        await consumer.start()
        try:
            committed = await consumer.committed(partition)
            consumer.subscribe(["durable"])
            return committed, await _read(consumer, 8)
        finally:
            await consumer.stop()

    with broker:
        asyncio.run(before())
        broker.kill()  # a crash: no controlled shutdown
        broker.start()  # the same directory and ports
        committed, rest = asyncio.run(after())
    assert committed == 12
    assert rest == [f"r{i}" for i in range(12, 20)]


def test_a_node_started_again_on_its_data_dir_finds_its_topics_users_and_acls(tmp_path) -> None:
    """`rlnode down`, then `rlnode up` on the same data dir: the broker's log is there, with
    the topics, the records, the services' users and their ACLs."""
    from rlnode.node.local import LocalNode, NodeOptions

    options = NodeOptions(data_dir=tmp_path / "node", services=("credential-vault",))
    with LocalNode(options) as first:
        asyncio.run(_produce(first.kafka_settings(), topics.JOB_REQUESTS, range(3)))
    with LocalNode(options) as again:

        async def held() -> list[str]:
            async with TopicReader(again.kafka_settings(), topics.JOB_REQUESTS, service="t") as r:
                records: list[str] = []
                while not r.caught_up.is_set():
                    records += [x.value.decode() for x in await r.fetch(timeout_ms=200)]
                return records

        assert asyncio.run(held()) == ["r0", "r1", "r2"]
        learner = {acl for acl in granted_sync(again.kafka_settings(), "learner")}
        assert {(a.operation, a.name) for a in learner} >= {
            ("Read", topics.JOB_REQUESTS),
            ("Write", topics.ROLLOUT_WORK),
            ("Read", topics.LEARNER_GROUP),
        }
    broker_dir = tmp_path / "node" / "broker"
    assert (broker_dir / "server.properties").stat().st_mode & 0o077 == 0
    assert (tmp_path / "node" / "secrets" / "kafka" / "users.json").stat().st_mode & 0o077 == 0


def test_compose_s_format_step_formats_a_broker_s_log_with_the_admin(tmp_path) -> None:
    """compose.yaml's brokers are formatted by a step of their own (the image's start cannot
    add a SCRAM user): its script, run by a shell with its broker's environment as compose
    gives it, formats the log directory with the node id and cluster id compose gives. Kafka's
    storage tool stands where the image has kafka-storage.sh; the secrets where compose
    mounts them are files of this test's."""
    import os
    import subprocess

    from rlnode.bus.localbroker import find_java, find_kafka_libs
    from rlnode.node.compose import (
        ADMIN_PASSWORD_ENV,
        KAFKA_CA_SECRET,
        KAFKA_DATA,
        KAFKA_KEYSTORE_SECRET,
        kafka_format_script,
        one_node_brokers,
    )

    identity = NodeCA.ensure(tmp_path / "ca").write_identity(
        tmp_path / "b", BROKER_CERT_NAME, ("kafka-2",)
    )
    bundle = tmp_path / "b" / "bundle.pem"
    bundle.write_bytes(identity.pem_bundle())
    mounted = {
        KAFKA_CA_SECRET: str(identity.ca),
        KAFKA_KEYSTORE_SECRET: str(bundle),
        KAFKA_DATA: str(tmp_path / "data"),
    }
    env = one_node_brokers()[2]
    # What compose makes of it: `$$` is `$`, the ${...} interpolated.
    container = {name: mounted.get(v, v).replace("$$", "$") for name, v in env.items()}
    container |= {"CLUSTER_ID": "MkU3OEVBNTcwNTJENDM2Qg", ADMIN_PASSWORD_ENV: "a-password"}
    storage_tool = f"{find_java()} -cp '{find_kafka_libs()}/*' kafka.tools.StorageTool"
    script = (
        kafka_format_script(env)
        .replace("$$", "$")
        .replace("/opt/kafka/bin/kafka-storage.sh", storage_tool)
        .replace("/tmp/format.properties", str(tmp_path / "format.properties"))
    )
    done = subprocess.run(
        ["sh", "-c", script],
        env={"PATH": os.environ["PATH"], **container},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    meta = (tmp_path / "data" / "meta.properties").read_text()
    assert "node.id=2" in meta and "cluster.id=MkU3OEVBNTcwNTJENDM2Qg" in meta
    written = (tmp_path / "format.properties").read_text()
    assert "RULE:^CN=([^,]+)$/$1/,DEFAULT" in written and "a-password" not in written
    assert (tmp_path / "format.properties").stat().st_mode & 0o077 == 0  # umask 077


def test_kafka_users_makes_each_service_s_login_and_acls_as_the_admin(tmp_path) -> None:
    """compose's `kafka-access` step: `rlnode kafka-users`, as the admin, gives each service
    the password compose's environment names and the ACLs its code declares; a missing
    password is named before anything is made."""
    import os
    import subprocess
    import sys

    from rlnode.bus.clients import refused_login
    from rlnode.node.compose import kafka_acls, kafka_password_variable, kafka_users

    identity = NodeCA.ensure(tmp_path / "ca").write_identity(
        tmp_path / "b", BROKER_CERT_NAME, ("127.0.0.1",)
    )
    admin = KafkaUser(ADMIN, "admin-password-of-this-test-0123456789")
    with LocalBroker(tmp_path / "kafka", identity, admin) as broker:
        admin_env = admin.client_env(broker.bootstrap_servers, identity.ca)
        passwords = {kafka_password_variable(u): f"pw-{u}-0123456789" for u in kafka_users()}
        env = {**os.environ, **admin_env, **passwords}
        run = [sys.executable, "-m", "rlnode.cli", "kafka-users"]
        missing = subprocess.run(
            run,
            env={k: v for k, v in env.items() if k != "KAFKA_LEARNER_PASSWORD"},
            capture_output=True,
            text=True,
        )
        assert missing.returncode == 2 and "missing: KAFKA_LEARNER_PASSWORD" in missing.stderr
        done = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        admin_settings = admin.client_settings(broker.bootstrap_servers, identity.ca)
        assert set(granted_sync(admin_settings)) >= set(kafka_acls())
        learner = KafkaUser("learner", passwords["KAFKA_LEARNER_PASSWORD"])
        settings = learner.client_settings(broker.bootstrap_servers, identity.ca)
        assert asyncio.run(refused_login(settings)) is None
        wrong = KafkaUser("learner", "not-its-password-0123456789")
        refusal = asyncio.run(
            refused_login(wrong.client_settings(broker.bootstrap_servers, identity.ca))
        )
        assert refusal is not None and "invalid credentials" in refusal
