"""Kafka through the TLS front (rlnode.bus.front): the embedded broker on loopback, haproxy
in front of it requiring a certificate of the node's CA. What is refused and what works,
with real clients; that Tansu is never started with its fail-open `--authentication`; and
the operator's `rlnode kafka-cert`."""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from rlnode.bus import ensure_topics
from rlnode.bus.front import KafkaTlsFront, find_haproxy
from rlnode.bus.localbroker import (
    FORBIDDEN_FLAGS,
    BrokerStartError,
    LocalBroker,
    find_tansu,
    free_port,
)
from rlnode.bus.pki import NodeCA
from rlnode.bus.settings import KafkaSettings
from rlnode.messages import topics
from rlnode.node.kafka_tls import client_identity, front_identity
from rlnode.node.testhosts import kafka_client_outcome

ROOT = Path(__file__).resolve().parents[2]

try:
    find_haproxy()
    HAPROXY = None
except Exception as e:
    HAPROXY = str(e)


def test_tansu_is_never_started_with_its_fail_open_authentication(tmp_path: Path) -> None:
    broker = LocalBroker(advertised="10.0.0.1:9093")
    argv = broker.command("tansu", "memory://tansu/")
    assert not FORBIDDEN_FLAGS.intersection(argv)
    assert argv[argv.index("--advertised-listener-url") + 1] == "tcp://10.0.0.1:9093"
    with pytest.raises(BrokerStartError, match="never started with"):
        LocalBroker(cluster_id="--authentication").command("tansu", "memory://tansu/")
    # Nothing else in the code starts it so: no source names the flag but the guard.
    offenders = []
    for folder in ("libs", "services", "bench", "tools", "deploy"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".sh", ".yaml", ".yml", ""):
                text = path.read_text(errors="ignore")
                if "--authentication" in text and path.name != "localbroker.py":
                    offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
    for compose in (ROOT / "compose.yaml", ROOT / "Dockerfile"):
        assert "--authentication" not in compose.read_text()
    # And the flag has no environment alias this guard would miss.
    help_text = subprocess.run(
        [find_tansu(), "broker", "--help"], capture_output=True, text=True, timeout=30
    ).stdout
    flag = next(line for line in help_text.splitlines() if "--authentication" in line)
    following = help_text.split(flag, 1)[1].split("\n      --", 1)[0]
    assert "[env:" not in flag + following


@pytest.mark.skipif(HAPROXY is not None, reason=f"no haproxy: {HAPROXY}")
async def test_the_front_lets_in_only_certificates_of_the_nodes_ca(tmp_path: Path) -> None:
    data_dir = tmp_path / "node"
    port = free_port()
    with LocalBroker(advertised=f"127.0.0.1:{port}") as broker:
        identity = front_identity(data_dir, ("127.0.0.1",))
        front = KafkaTlsFront(
            "127.0.0.1", broker.bootstrap_servers, identity, tmp_path / "front", port=port
        )
        with front:
            member = client_identity(data_dir, "learner")
            good = KafkaSettings(bootstrap_servers=front.address, **_tls(member))
            assert await ensure_topics(good) == list(topics.ALL_TOPICS)
            assert (await kafka_client_outcome(good)).startswith("topics: ")

            plain = KafkaSettings(bootstrap_servers=front.address)
            bare = ssl.create_default_context(cafile=str(member.ca))
            other = NodeCA.ensure(tmp_path / "other").write_identity(tmp_path / "m", "mallory")
            foreign = ssl.create_default_context(cafile=str(member.ca))
            foreign.load_cert_chain(other.cert, other.key)
            for overrides in ({}, {"security_protocol": "SSL", "ssl_context": bare}):
                assert (await kafka_client_outcome(plain, **overrides)).startswith("refused")
            refused = await kafka_client_outcome(
                plain, security_protocol="SSL", ssl_context=foreign
            )
            assert refused.startswith("refused")
            for path in (member.cert, member.key, member.ca):
                assert path.stat().st_mode & 0o777 == 0o600


def test_the_settings_name_what_tls_is_missing() -> None:
    with pytest.raises(ValueError, match="KAFKA_SSL_CERTFILE, KAFKA_SSL_KEYFILE"):
        KafkaSettings(security_protocol="SSL", ssl_cafile=Path("/ca.pem"))


def test_kafka_cert_issues_for_a_node_with_a_ca_and_says_why_not_without(tmp_path: Path) -> None:
    def kafka_cert(data_dir: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "rlnode.cli", "kafka-cert", *args],
            env={"RLNODE_DATA_DIR": str(data_dir), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
        )

    refused = kafka_cert(tmp_path / "none", "alice", "--out", str(tmp_path / "a"))
    assert refused.returncode == 2 and "no Kafka CA" in refused.stderr
    client_identity(tmp_path / "node", "rlnode-operator")  # the node made its CA
    done = kafka_cert(tmp_path / "node", "alice", "--out", str(tmp_path / "alice"))
    assert done.returncode == 0, done.stderr
    assert f"export KAFKA_SSL_CERTFILE={tmp_path / 'alice' / 'alice.pem'}" in done.stdout
    assert (tmp_path / "alice" / "alice.key").stat().st_mode & 0o777 == 0o600
    bad = kafka_cert(tmp_path / "node", "../etc", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "certificate name" in bad.stderr


def _tls(identity) -> dict:
    return {
        "security_protocol": "SSL",
        "ssl_cafile": identity.ca,
        "ssl_certfile": identity.cert,
        "ssl_keyfile": identity.key,
    }
