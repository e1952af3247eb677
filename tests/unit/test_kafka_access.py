"""Who may do what on the node's Kafka, without a broker: the ACLs generated from topics.py,
an org's names that no other org's prefix covers, the users' passwords kept, and the
broker's configuration secured (tests/security/test_kafka_acls.py tries them on a broker)."""

from __future__ import annotations

import itertools
import stat
from pathlib import Path

import pytest

from rlnode.bus.acls import org_acls, org_user, service_acls
from rlnode.bus.localbroker import LocalBroker, Voter
from rlnode.bus.pki import NodeCA
from rlnode.bus.principals import ADMIN, BROKER_CERT_NAME, KafkaUser, PrincipalError, UserStore
from rlnode.bus.settings import KafkaSettings
from rlnode.messages import topics


def test_each_service_may_do_what_topics_py_says_and_no_more() -> None:
    granted = service_acls()
    for service, read in topics.READERS.items():
        mine = {(a.operation, a.kind, a.name) for a in granted if a.user == service}
        reads = {name for op, kind, name in mine if op == "Read" and kind == "topic"}
        assert reads == set(read), service
        groups = {name for op, kind, name in mine if kind == "group"}
        assert groups == set(topics.GROUPS[service]), service
        writes = {name for op, kind, name in mine if op == "Write" and kind == "topic"}
        wanted = {t for t, producers in topics.PRODUCERS.items() if service in producers}
        if service in topics.JOB_REQUEST_WRITERS:
            wanted.add(topics.JOB_REQUESTS)
        if service == topics.ORG_EVENTS_COPIER:
            wanted.add(topics.ORG_PREFIX)  # prefixed: every org's own topic
        assert writes == wanted, service
    prefixed = {(a.user, a.operation) for a in granted if a.pattern == "prefixed"}
    assert prefixed == {
        (topics.LEARNER, "Create"),
        (topics.LEARNER, "Describe"),
        (topics.ORG_EVENTS_COPIER, "Write"),
        (topics.ORG_EVENTS_COPIER, "Describe"),
    }


def test_an_org_writes_job_requests_and_reads_only_under_its_own_prefix() -> None:
    acls = org_acls("acme")
    assert {a.user for a in acls} == {org_user("acme")}
    writes = {(a.name, a.pattern) for a in acls if a.operation == "Write"}
    assert writes == {(topics.JOB_REQUESTS, "literal")}
    reads = {(a.kind, a.name, a.pattern) for a in acls if a.operation == "Read"}
    assert reads == {
        ("topic", topics.org_prefix("acme"), "prefixed"),
        ("group", topics.org_prefix("acme"), "prefixed"),
    }
    assert topics.org_events("acme").startswith(topics.org_prefix("acme"))
    assert topics.is_org_events(topics.org_events("acme"))


def test_no_orgs_prefix_covers_another_orgs_names() -> None:
    """Org ids may hold dots: the length in the prefix keeps `a` off `a.b`'s names."""
    ids = ["a", "b", "a.b", "a.b.c", "ab", "a-b", "1", "12", "1.2", "a.", "x" * 10, "x" * 100]
    for mine, theirs in itertools.permutations(ids, 2):
        for name in (topics.org_events(theirs), topics.org_prefix(theirs) + "group"):
            assert not name.startswith(topics.org_prefix(mine)), (mine, theirs, name)
    assert topics.org_prefix("a") == "rlnode.org-1.a."


def test_only_the_copier_may_produce_on_an_orgs_topic() -> None:
    topic = topics.org_events("acme")
    assert topics.may_produce(topics.ORG_EVENTS_COPIER, topic, object())
    assert not topics.may_produce(topics.LEARNER, topic, object())
    assert topics.retention_configs(topic) == topics.retention_configs(topics.JOB_EVENTS)


def test_users_keep_their_password_until_forgotten(tmp_path: Path) -> None:
    store = UserStore.of_node(tmp_path)
    first = store.user("learner")
    assert store.user("learner") == first and len(first.password) >= 40
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert store.existing("nobody") is None
    store.forget("learner")
    assert store.user("learner").password != first.password
    with pytest.raises(PrincipalError, match="Kafka user name"):
        store.user("no spaces")


def test_a_users_login_goes_to_a_process_and_back(tmp_path: Path) -> None:
    user = KafkaUser("org-acme", "s3cret")
    env = user.client_env("10.0.0.1:9092", tmp_path / "ca.pem")
    assert env["KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert env["KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512"
    again = KafkaSettings.from_exports(env)
    assert again.sasl_username == "org-acme" and again.sasl_password is not None
    assert again.sasl_password.get_secret_value() == "s3cret"
    assert again.connection_env() == env


def test_the_nodes_broker_is_secured_and_the_open_one_is_not(tmp_path: Path) -> None:
    ca = NodeCA.ensure(tmp_path / "ca")
    identity = ca.write_identity(tmp_path / "broker", BROKER_CERT_NAME, ("127.0.0.1",))
    admin = KafkaUser(ADMIN, "pw")
    secured = LocalBroker(tmp_path / "k", identity, admin, port=9092, controller_port=9093)
    props = secured.properties()
    assert props["listener.security.protocol.map"] == "BROKER:SASL_SSL,CONTROLLER:SSL"
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["listener.name.controller.ssl.client.auth"] == "required"
    assert props["super.users"] == f"User:{ADMIN};User:{BROKER_CERT_NAME}"
    assert props["auto.create.topics.enable"] == "false"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:9093"
    opened = LocalBroker(tmp_path / "o", port=9094, controller_port=9095).properties()
    assert "authorizer.class.name" not in opened
    assert opened["listener.security.protocol.map"] == "BROKER:PLAINTEXT,CONTROLLER:PLAINTEXT"
    cluster = LocalBroker(
        tmp_path / "c",
        identity,
        admin,
        node_id=2,
        voters=(Voter(1, "10.0.0.1", 9093), Voter(2, "10.0.0.2", 9093), Voter(3, "10.0.0.3", 9093)),
        replication=3,
    ).properties()
    assert cluster["controller.quorum.voters"] == "1@10.0.0.1:9093,2@10.0.0.2:9093,3@10.0.0.3:9093"
    assert cluster["min.insync.replicas"] == "2" and cluster["default.replication.factor"] == "3"
    with pytest.raises(ValueError, match="both its identity and the admin"):
        LocalBroker(tmp_path / "x", identity=identity)
