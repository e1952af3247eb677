"""The node's Kafka from the outside, as someone with a Kafka client of their own would try
it: without a login, with a wrong password, with a service's login on what that service
does not own, and with org A's own login on org B's events and groups and on the services'
topics. Each is refused by the broker (SASL, ACLs deny-by-default), and the error names the
user where a login was refused; what is theirs works."""

from __future__ import annotations

import asyncio
import ssl

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from pydantic import SecretStr

from rlnode.bus import Bus, BusError, KafkaSettings
from rlnode.bus.clients import connection
from rlnode.messages import topics
from rlnode.node.kafka_access import grant_org
from rlnode.node.testhosts import kafka_client_outcome
from rlnode.sdk.jobs import JobsClient
from rlnode.service.registry import VAULT
from rlnode.testing import unique_id
from tests.security.conftest import AttackedNode


async def _read(settings: KafkaSettings, topic: str, group: str | None = None) -> str:
    """'read' when the broker served a fetch of `topic` (in `group`, if given), else the
    refusal's name."""
    consumer = AIOKafkaConsumer(
        **connection(settings),
        group_id=group,
        auto_offset_reset="earliest",
        request_timeout_ms=10_000,
        session_timeout_ms=6000,
        heartbeat_interval_ms=2000,
    )
    try:
        await asyncio.wait_for(consumer.start(), 20)
        if group is None:
            # A topic the user may not describe is left out of its metadata (aiokafka then
            # waits for its leader rather than raise): the refusal, said as such.
            if topic not in await consumer.topics():
                return "refused: TopicAuthorizationFailedError (not even described)"
            consumer.assign([TopicPartition(topic, 0)])
        else:
            consumer.subscribe([topic])
        await asyncio.wait_for(consumer.getmany(timeout_ms=2000), 20)
        return "read"
    except Exception as e:
        return f"refused: {type(e).__name__}"
    finally:
        await consumer.stop()


async def _write(settings: KafkaSettings, topic: str) -> str:
    producer = AIOKafkaProducer(**connection(settings), request_timeout_ms=10_000)
    try:
        await asyncio.wait_for(producer.start(), 20)
        await asyncio.wait_for(producer.send_and_wait(topic, b"{}", key=b"attack"), 20)
        return "written"
    except Exception as e:
        return f"refused: {type(e).__name__}"
    finally:
        await producer.stop()


def test_without_a_login_the_broker_gives_nothing(attacked: AttackedNode) -> None:
    node = attacked.node
    plain = KafkaSettings(bootstrap_servers=node.bootstrap)
    assert node.kafka_ca is not None
    tls_only = ssl.create_default_context(cafile=str(node.kafka_ca))
    outcomes = {
        "plain": asyncio.run(kafka_client_outcome(plain)),
        "tls without a login": asyncio.run(
            kafka_client_outcome(plain, security_protocol="SSL", ssl_context=tls_only)
        ),
    }
    assert all(o.startswith("refused") for o in outcomes.values()), outcomes


def test_a_wrong_password_is_refused_naming_the_user(attacked: AttackedNode) -> None:
    good = attacked.node.kafka_settings("rollout-generator")
    wrong = good.model_copy(update={"sasl_password": SecretStr("guessed")})
    assert asyncio.run(kafka_client_outcome(good)).startswith("topics: ")

    async def start() -> None:
        bus = Bus(wrong, service="attacker")
        try:
            await bus.start()
        finally:
            await bus.stop()

    with pytest.raises(BusError, match=r"refused the login of Kafka user 'rollout-generator'"):
        asyncio.run(start())


# (user, what it tries, the topic, the group): none of it is the user's by topics.py.
NOT_THEIRS = [
    ("rollout-generator", "read", topics.JOB_REQUESTS, None),
    ("rollout-generator", "read", topics.TRAJECTORIES, None),
    ("rollout-generator", "write", topics.WEIGHT_VERSIONS, None),
    ("rollout-generator", "write", topics.ROLLOUT_WORK, None),
    ("rollout-generator", "join", topics.WEIGHT_VERSIONS, topics.LEARNER_GROUP),
    ("checkpoint-server", "read", topics.TRAJECTORIES, None),
    ("checkpoint-server", "write", topics.WEIGHT_VERSIONS, None),
    ("tinker-api", "read", topics.JOB_EVENTS, None),
    ("tinker-api", "write", topics.TINKER_RESULTS, None),
    ("learner", "join", topics.JOB_REQUESTS, topics.ROLLOUT_GENERATOR_GROUP),
]


@pytest.mark.parametrize(("user", "action", "topic", "group"), NOT_THEIRS)
def test_a_services_login_reaches_nothing_that_is_not_its_own(
    attacked: AttackedNode, user: str, action: str, topic: str, group: str | None
) -> None:
    settings = attacked.node.kafka_settings(user)
    if action == "write":
        outcome = asyncio.run(_write(settings, topic))
    else:
        outcome = asyncio.run(_read(settings, topic, group))
    assert outcome.startswith("refused: ") and "Authorization" in outcome, outcome


def test_a_services_login_reaches_what_is_its_own(attacked: AttackedNode) -> None:
    """The same logins do what topics.py gives them (the refusals above are the ACLs', not a
    broken login's): a generator reads weight versions; a group of its own name is not its."""
    generator = attacked.node.kafka_settings("rollout-generator")
    assert asyncio.run(_read(generator, topics.WEIGHT_VERSIONS)) == "read"
    outcome = asyncio.run(_read(generator, topics.WEIGHT_VERSIONS, unique_id("group")))
    assert outcome == "refused: GroupAuthorizationFailedError", outcome


# -- orgs' own logins (rlnode kafka-credentials) --------------------------------------------


def _org_login(attacked: AttackedNode, org_id: str) -> KafkaSettings:
    node = attacked.node
    assert node.kafka_ca is not None
    access = asyncio.run(grant_org(node.kafka_settings(), node.data_dir, org_id))
    return access.client_settings(node.bootstrap, node.kafka_ca)


def test_an_orgs_login_reads_its_own_jobs_events_from_its_own_topic(
    attacked: AttackedNode,
) -> None:
    """The victim's finished job, followed with the victim's own Kafka login: its events come
    from the org's topic (the checkpoint-server's signed copies), as they are on the shared
    one."""
    node, victim = attacked.node, attacked.victim
    login = _org_login(attacked, victim.org_id)

    async def history(kafka: KafkaSettings) -> list[str]:
        async with JobsClient(victim.org_id, victim.token, kafka, "org", node.url(VAULT.name)) as c:
            assert c.events_topic == (
                topics.org_events(victim.org_id) if kafka is login else topics.JOB_EVENTS
            )
            return [f"{e.id} {e.type.value}" for e in await c.history(attacked.victim_job)]

    own = asyncio.run(history(login))
    assert own == asyncio.run(history(node.kafka_settings())), own
    assert own[0].endswith("job.accepted") and own[-1].endswith("job.completed"), own


# (what the attacker's login tries, the topic, the group): none of it is the attacker's.
ORG_NOT_THEIRS = [
    ("read", lambda a, v: topics.JOB_EVENTS, None),
    ("read", lambda a, v: topics.JOB_REQUESTS, None),
    ("read", lambda a, v: topics.TRAJECTORIES, None),
    ("read", lambda a, v: topics.org_events(v), None),
    ("join", lambda a, v: topics.org_events(a), lambda a, v: topics.org_prefix(v) + "g"),
    ("join", lambda a, v: topics.org_events(a), lambda a, v: topics.LEARNER_GROUP),
    ("write", lambda a, v: topics.JOB_EVENTS, None),
    ("write", lambda a, v: topics.WEIGHT_VERSIONS, None),
    ("write", lambda a, v: topics.org_events(v), None),
    ("write", lambda a, v: topics.org_events(a), None),  # only the copier writes there
]


@pytest.mark.parametrize(
    ("action", "topic", "group"),
    ORG_NOT_THEIRS,
    ids=[
        "read-job-events",
        "read-job-requests",
        "read-trajectories",
        "read-other-orgs-events",
        "join-other-orgs-group",
        "join-learner-group",
        "write-job-events",
        "write-weight-versions",
        "write-other-orgs-events",
        "write-own-events",
    ],
)
def test_an_orgs_login_reaches_nothing_of_another_orgs_or_the_services(
    attacked: AttackedNode, action: str, topic, group
) -> None:
    attacker, victim = attacked.attacker.org_id, attacked.victim.org_id
    _org_login(attacked, victim)  # the victim's topic exists
    login = _org_login(attacked, attacker)
    name = topic(attacker, victim)
    if action == "write":
        outcome = asyncio.run(_write(login, name))
    else:
        outcome = asyncio.run(_read(login, name, group(attacker, victim) if group else None))
    assert outcome.startswith("refused: ") and "Authorization" in outcome, outcome


def test_an_orgs_login_reads_and_joins_what_is_its_own(attacked: AttackedNode) -> None:
    attacker = attacked.attacker.org_id
    login = _org_login(attacked, attacker)
    own = topics.org_events(attacker)
    assert asyncio.run(_read(login, own)) == "read"
    assert asyncio.run(_read(login, own, topics.org_prefix(attacker) + unique_id("g"))) == "read"
    assert asyncio.run(_write(login, topics.JOB_REQUESTS)) == "written"
