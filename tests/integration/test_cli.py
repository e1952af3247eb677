"""The `rlnode` command as a user runs it: a real process, real output, real exit codes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from rlnode.bus.localbroker import free_port
from rlnode.messages import topics
from rlnode.testing import processes_with

RLNODE = [sys.executable, "-m", "rlnode.cli"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    return {**env, **extra}


def test_doctor_passes_on_the_embedded_defaults(tmp_path) -> None:
    result = subprocess.run(
        [*RLNODE, "doctor"],
        env=_env(RLNODE_DATA_DIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the node's Apache Kafka" in result.stdout
    assert "all 10 checks passed" in result.stdout
    for name in (
        "credential-vault",
        "taskapp-gateway",
        "rollout-generator",
        "learner",
        "checkpoint-server",
        "tinker-api",
    ):
        assert re.search(rf"ok\s+service {name}", result.stdout)
        assert (tmp_path / "logs" / f"{name}.log").is_file()
    # Which network managed Task Apps get here (as root, with nft: isolated).
    if os.geteuid() == 0:
        assert "managed Task Apps' network: isolated by nftables" in result.stdout


def test_doctor_uses_the_broker_it_is_given(kafka_broker, tmp_path) -> None:
    result = subprocess.run(
        [*RLNODE, "doctor"],
        env=_env(
            RLNODE_DATA_DIR=str(tmp_path), KAFKA_BOOTSTRAP_SERVERS=kafka_broker.bootstrap_servers
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"broker: {kafka_broker.bootstrap_servers} (KAFKA_BOOTSTRAP_SERVERS)" in result.stdout


def test_doctor_fails_loudly_when_the_broker_is_down(tmp_path) -> None:
    result = subprocess.run(
        [*RLNODE, "doctor"],
        env=_env(
            RLNODE_DATA_DIR=str(tmp_path),
            KAFKA_BOOTSTRAP_SERVERS=f"127.0.0.1:{free_port()}",
            KAFKA_REQUEST_TIMEOUT_MS="2000",
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "FAIL topics" in result.stdout and "cannot reach Kafka" in result.stdout


def test_topics_create_needs_a_broker_address() -> None:
    result = subprocess.run(
        [*RLNODE, "topics", "create"], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "KAFKA_BOOTSTRAP_SERVERS is not set" in result.stderr


def test_topics_create_on_a_running_broker(kafka_broker) -> None:
    result = subprocess.run(
        [*RLNODE, "topics", "create"],
        env=_env(KAFKA_BOOTSTRAP_SERVERS=kafka_broker.bootstrap_servers),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    for name in topics.ALL_TOPICS:
        assert re.search(rf"^{re.escape(name)}\s+(created|exists)$", result.stdout, re.M)


def test_broker_command_serves_until_sigterm(tmp_path) -> None:
    """`rlnode broker`: the node's Kafka alone, and the exports that log in as its admin."""
    port = free_port()
    proc = subprocess.Popen(
        [*RLNODE, "broker", "--port", str(port)],
        env=_env(RLNODE_DATA_DIR=str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith(f"Apache Kafka ready on 127.0.0.1:{port}"), first
        exports = {}
        while (line := proc.stdout.readline()) and not line.startswith("Ctrl-C"):
            if line.strip().startswith("export "):
                name, value = line.strip().removeprefix("export ").split("=", 1)
                exports[name] = value
        assert exports["KAFKA_BOOTSTRAP_SERVERS"] == f"127.0.0.1:{port}"
        assert exports["KAFKA_SASL_USERNAME"] == "admin", exports
        # What it printed logs in: the topics are there, as the admin sees them.
        listed = subprocess.run(
            [*RLNODE, "topics", "create"],
            env=_env(**exports),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert listed.returncode == 0, listed.stdout + listed.stderr
        assert all(f"{name}" in listed.stdout for name in topics.ALL_TOPICS)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # The broker's JVM runs in a session of its own: gone with it, or killed here.
        for pid in processes_with(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)


def test_kafka_credentials_needs_the_nodes_admin(tmp_path) -> None:
    """No node up here and no KAFKA_* admin: it says where to run it, and makes nothing."""
    result = subprocess.run(
        [*RLNODE, "kafka-credentials", "acme"],
        env=_env(RLNODE_DATA_DIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no Kafka admin login here" in result.stderr
    assert not (tmp_path / "secrets" / "kafka" / "users.json").exists()
