"""A node over three hosts, each a network namespace of its own (rlnode.node.testhosts):
every host runs one broker of a three-broker Apache Kafka cluster (`rlnode kafka-cluster`,
then `rlnode broker --cluster` on each: replication 3, min.insync.replicas 2, acks=all,
idempotent producers); host A runs the control and training roles (vault, gateway with the
managed Task App, learner, checkpoint-server), hosts B and C a rollout-generator each. Every
host has its own tmpfs over the weights directory, so B and C cannot read the learner's
weight versions from shared memory: they fetch them over HTTP. Mid-job B's broker is
SIGKILLed (its `rlnode broker` starts it again), then B's generator (B's supervisor starts it
again), and later C's link is taken down for good, its broker and generator with it. The job
completes, its chain of checkpoints trained every work item exactly once, and its events
have every step and checkpoint.

Each host is brought up as an operator would: the brokers from the control host's plan, then
`rlnode up --role ... --host <its address>` with the cluster's KAFKA_* on the control host,
the others with `--join` and the control host's join file. Only the test hosts' addresses
are used between hosts (each service listens on its host's address, not loopback)."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from pydantic import SecretStr

from rlnode import testing
from rlnode.bus.settings import KafkaSettings
from rlnode.examples import example_job
from rlnode.messages import JobEventType
from rlnode.models.build import init_tiny_model
from rlnode.node import testhosts as hosts
from rlnode.node.chaos import trained_once
from rlnode.node.kafka_cluster import DEFAULT_CONTROLLER_PORT as CONTROLLER_PORT
from rlnode.node.roles import JoinInfo, join_path
from rlnode.node.testhosts import BrokerHost, HostProcess, User, kafka_client_outcome

pytestmark = pytest.mark.skipif(
    (why := hosts.available()) is not None, reason=f"no test hosts here: {why}"
)

STEPS, PROMPTS, GROUP = 24, 2, 4  # long enough that every fault lands mid-job
GENERATOR = "rollout-generator/gen0"


@pytest.fixture(scope="module")
def network() -> Iterator[hosts.TestNetwork]:
    with hosts.TestNetwork() as net:
        yield net


@pytest.mark.timeout(900)
def test_a_job_over_three_hosts_survives_a_killed_broker_and_generator_and_a_pulled_cable(
    network: hosts.TestNetwork, tmp_path: Path
) -> None:
    a, b, c = (network.add_host(name) for name in ("a", "b", "c"))
    weights = tmp_path / "weights"  # a tmpfs of its own on each host
    weights.mkdir()
    model = init_tiny_model(tmp_path / "tiny", seed=0)  # every host reads the model's files
    with ExitStack() as stack:
        plans, cluster = hosts.plan_cluster(tmp_path / "a", [a, b, c])
        brokers = []
        for host, plan in zip((a, b, c), plans, strict=True):
            broker = BrokerHost(host, tmp_path / f"kafka-{host.name}", plan)
            stack.callback(broker.stop)
            brokers.append(broker)
        for broker in brokers:  # each waits for a quorum of the others to start
            broker.wait_started(1, 180)
        control = HostProcess(a, tmp_path / "a", ["--role", "control,training"], weights, cluster)
        stack.callback(control.stop)
        control.wait_up(180)
        join_file = join_path(control.data_dir)
        join = JoinInfo.read(join_file)
        assert join.bootstrap == cluster["KAFKA_BOOTSTRAP_SERVERS"]
        assert all(a.address in url for url in (join.vault_url, join.learner_url))
        # The user, from this machine: an org, its key, a Kafka login.
        user = User.create(control)
        check_kafka_is_authenticated(join, user, b)
        inference = []
        for host in (b, c):
            process = HostProcess(
                host,
                tmp_path / host.name,
                ["--role", "inference", "--join", str(join_file)],
                weights,
            )
            stack.callback(process.stop)
            inference.append(process)
        states = [p.wait_up(180) for p in inference]
        for host, state in zip((b, c), states, strict=True):
            assert state["services"][GENERATOR]["url"].startswith(f"http://{host.address}:")

        # The managed Task App, a job.
        assert user.register_example_task_app("copy", "copy_task")["ok"]
        config = example_job(
            "copy_task",
            model,
            steps=STEPS,
            prompts_per_step=PROMPTS,
            group_size=GROUP,
            checkpoint_every=2,
            max_async=1,
        )
        job_id = user.start(config)

        def at_step(step: int):
            return lambda: user.learner_job(job_id).get("step", 0) >= step

        testing.wait_until(at_step(2), 300, f"{job_id} at step 2")
        # B's broker and generator SIGKILLed, as a crash: two brokers carry on
        # (min.insync.replicas 2); `rlnode broker` starts B's again and it catches up, and
        # B's supervisor starts its generator again.
        killed_broker = brokers[1].starts()[-1]
        killed = inference[0].wait_up(10)["services"][GENERATOR]["pid"]
        os.kill(killed_broker, signal.SIGKILL)
        os.kill(killed, signal.SIGKILL)
        testing.wait_until(at_step(6), 300, f"{job_id} at step 6 after B's broker and generator")
        assert brokers[1].wait_started(2, 180) != killed_broker
        # C's cable pulled mid-job, for good: its broker is gone (A's and B's carry on), its
        # work goes to B once C leaves the group.
        c.link(up=False)
        assert user.learner_job(job_id)["status"] == "running", "the job ended before the pull"
        done = user.wait_for_end(job_id, 600)
        assert done["status"] == "completed", (done, control.tail())
        restarted = inference[0].wait_up(10)["services"][GENERATOR]
        # The kill is its only exit: one that broke on the lost broker or cable is a defect.
        assert restarted["restarts"] == 1, inference[0].exits(GENERATOR)
        assert restarted["pid"] != killed

        events = user.events(job_id)
        loaded = [e.data for e in events if e.type == JobEventType.WEIGHTS_LOADED]
        by_host = {
            host.address: [d for d in loaded if d["generator"].endswith(f"@{host.address}")]
            for host in (b, c)
        }
        assert by_host[b.address] and by_host[c.address], loaded
        # Neither generator could see the learner's shared memory: every version came over HTTP.
        assert {d["transport"] for d in loaded} == {"http"}, loaded
        # No job event lost to the broker that died or the one cut off.
        steps = {e.data["step"] for e in events if e.type == JobEventType.TRAIN_STEP}
        saved = {e.data["step"] for e in events if e.type == JobEventType.CHECKPOINT_SAVED}
        assert steps == set(range(1, STEPS + 1)), sorted(steps)
        assert saved >= set(range(2, STEPS + 1, 2)), sorted(saved)
        assert [e.type for e in events].count(JobEventType.COMPLETED) == 1

    checkpoints = control.data_dir / "checkpoints" / user.org_id / job_id / "checkpoints"
    assert trained_once(checkpoints, job_id, STEPS, PROMPTS, GROUP) == (0, 0)
    assert done["step"] == STEPS


def check_kafka_is_authenticated(join: JoinInfo, user: User, other: hosts.Host) -> None:
    """Across hosts, Kafka is SASL_SSL with the node's users: a plain client, TLS without a
    login and a wrong password are refused; a controller takes only the brokers' own
    certificate (TLS with the CA but no certificate is refused); the user's login works."""
    assert join.kafka and user.kafka.ssl_cafile is not None
    plain = KafkaSettings(bootstrap_servers=join.bootstrap)
    tls_only = ssl.create_default_context(cafile=str(user.kafka.ssl_cafile))
    wrong = user.kafka.model_copy(update={"sasl_password": SecretStr("not-the-password")})
    controller = KafkaSettings(bootstrap_servers=f"{other.address}:{CONTROLLER_PORT}")
    outcomes = {
        "plain": asyncio.run(kafka_client_outcome(plain)),
        "tls without a login": asyncio.run(
            kafka_client_outcome(plain, security_protocol="SSL", ssl_context=tls_only)
        ),
        "a wrong password": asyncio.run(kafka_client_outcome(wrong)),
        "a controller, TLS without the brokers' certificate": asyncio.run(
            kafka_client_outcome(controller, security_protocol="SSL", ssl_context=tls_only)
        ),
    }
    assert all(o.startswith("refused") for o in outcomes.values()), outcomes
    assert asyncio.run(kafka_client_outcome(user.kafka)).startswith("topics: "), user.kafka
