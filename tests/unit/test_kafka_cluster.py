"""A cluster planned on the control host (rlnode.node.kafka_cluster), without a broker: one
cluster id and voter list in every broker's file, each broker's certificate good for its own
host only, the files private, the node's exports naming every broker; bad plans and files
refused with what to do (tests/multihost runs the planned cluster)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from cryptography import x509

from rlnode.bus.localbroker import Voter
from rlnode.bus.principals import ADMIN, BROKER_CERT_NAME
from rlnode.bus.settings import KafkaSettings
from rlnode.node.kafka_access import ca_certificate, users
from rlnode.node.kafka_cluster import BrokerPlan, ClusterPlanError, cluster_env, plan_cluster

HOSTS = ["10.9.0.1", "10.9.0.2", "10.9.0.3"]


def test_every_broker_gets_the_same_cluster_and_a_certificate_for_its_own_host(tmp_path) -> None:
    files = plan_cluster(tmp_path, HOSTS)
    plans = [BrokerPlan.read(f) for f in files]
    assert [p.node_id for p in plans] == [1, 2, 3] and [p.host for p in plans] == HOSTS
    assert len({p.cluster_id for p in plans}) == 1
    voters = [str(Voter(i, h, 9093)) for i, h in enumerate(HOSTS, start=1)]
    assert all(p.voters == voters for p in plans)
    for plan, path in zip(plans, files, strict=True):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the admin's login, a key
        cert = x509.load_pem_x509_certificate(plan.cert_pem.encode())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == [plan.host]
        assert cert.subject.rfc4514_string() == f"CN={BROKER_CERT_NAME}"
        assert plan.ca_pem.encode() == ca_certificate(tmp_path).read_bytes()
        assert (plan.admin, plan.admin_password) == (ADMIN, users(tmp_path).user(ADMIN).password)
        assert "PRIVATE KEY" not in plan.ca_pem  # the CA's key stays on the control host


def test_a_broker_file_makes_a_broker_of_the_cluster(tmp_path) -> None:
    plan = BrokerPlan.read(plan_cluster(tmp_path / "control", HOSTS)[1])
    broker = plan.broker(tmp_path / "host-b")
    properties = broker.properties()
    assert properties["node.id"] == "2"
    assert properties["controller.quorum.voters"] == ",".join(plan.voters)
    assert properties["listeners"] == "BROKER://10.9.0.2:9092,CONTROLLER://10.9.0.2:9093"
    assert properties["default.replication.factor"] == "3"
    assert properties["min.insync.replicas"] == "2"
    assert properties["listener.name.controller.ssl.client.auth"] == "required"
    assert broker.cluster_id == plan.cluster_id


def test_the_node_talks_to_every_broker_as_the_admin_with_three_replicas(tmp_path) -> None:
    plan = BrokerPlan.read(plan_cluster(tmp_path, HOSTS)[0])
    env = cluster_env(tmp_path, plan)
    assert env["KAFKA_BOOTSTRAP_SERVERS"] == "10.9.0.1:9092,10.9.0.2:9092,10.9.0.3:9092"
    assert env["KAFKA_REPLICATION_FACTOR"] == "3"
    settings = KafkaSettings.from_exports(env)
    assert settings.security_protocol == "SASL_SSL" and settings.sasl_username == ADMIN
    assert settings.replication_factor == 3


@pytest.mark.parametrize(
    ("hosts", "said"),
    [
        (HOSTS[:2], "three or more"),
        ([HOSTS[0], HOSTS[0], HOSTS[1]], "distinct"),
    ],
)
def test_a_plan_without_three_distinct_hosts_is_refused(tmp_path, hosts, said) -> None:
    with pytest.raises(ClusterPlanError, match=said):
        plan_cluster(tmp_path, hosts)


def test_a_file_that_is_not_a_broker_file_says_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "broker-1.json"
    path.write_text(json.dumps({"version": 1, "host": "10.9.0.1"}))
    with pytest.raises(ClusterPlanError, match="plan the cluster again"):
        BrokerPlan.read(path)
    with pytest.raises(ClusterPlanError, match="cannot read"):
        BrokerPlan.read(tmp_path / "missing.json")
