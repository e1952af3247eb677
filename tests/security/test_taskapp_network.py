"""A managed Task App of org A, running a rollout of A's own job, tries every listening port
of the machine and the node's internals by name (tests/security/scan_taskapp.py). It must
reach the generator's rollout endpoint and nothing else: not the broker (as a Kafka client
it reads no job event, no trajectory, and cannot join the learner's group), not the
broker's controller, the learner's weight route, the vault, or org B's Task App. And its
own job still trains."""

from __future__ import annotations

import sys
from pathlib import Path
from urllib.parse import urlsplit

from rlnode.examples import example_job
from rlnode.messages import JobEventType
from rlnode.sdk.gateway import GatewayClient
from tests.security.conftest import AttackedNode
from tests.security.test_taskapp_sandbox import attack_report, shared_copy

SCAN = Path(__file__).with_name("scan_taskapp.py")


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


def test_a_managed_task_app_reaches_its_rollout_endpoint_and_nothing_else(
    attacked: AttackedNode,
) -> None:
    node = attacked.node
    assert node.broker is not None, "the node runs its own broker"
    victim_job = attacked.victim_job
    env = {
        "TARGET_BOOTSTRAP": node.bootstrap,
        "TARGET_WEIGHTS_URL": f"{node.url('learner')}/v1/weights/"
        f"{attacked.victim.org_id}/{victim_job}/1",
        "TARGET_VAULT_URL": node.url("credential-vault"),
    }
    with GatewayClient(node.url("taskapp-gateway"), attacked.victim.token) as victim_gateway:
        victim_app = victim_gateway.get("copy")["url"]
    with GatewayClient(node.url("taskapp-gateway"), attacked.attacker.token) as gateway:
        gateway.register("scan", command=[sys.executable, str(shared_copy(SCAN))], env=env)
        assert gateway.verify("scan")["ok"]
        config = example_job("copy_task", attacked.model, steps=1, group_size=4, prompts_per_step=2)
        config = config.model_copy(
            update={"task_app": config.task_app.model_copy(update={"name": "scan"})}
        )
        _, events = node.run_job(attacked.attacker, config, idle_timeout_s=180)
        report = attack_report(gateway, "scan", marker="SCAN ")
        gateway.remove("scan")

    # Its own job trained: the rollouts came back scored.
    steps = [e for e in events if e.type == JobEventType.TRAIN_STEP]
    assert steps and events[-1].type == JobEventType.COMPLETED

    generators = {
        _port(p.url) for key, p in node.processes.items() if key.startswith("rollout-generator")
    }
    internals = {
        "broker": _port("tcp://" + node.bootstrap),
        "broker's controller": node.broker.controller_port,
        "vault": _port(node.url("credential-vault")),
        "gateway": _port(node.url("taskapp-gateway")),
        "learner": _port(node.url("learner")),
        "checkpoint-server": _port(node.url("checkpoint-server")),
        "org B's Task App": _port(victim_app),
    }
    listening = {port for _, port in report["listening"]}
    assert set(internals.values()) <= listening, (internals, report["listening"])
    reached = {port for _, port in report["reached"]}
    # The one it needs, of every port the machine listens on (PostgreSQL and the rest too),
    # and its own (cgroups.py): not org B's Task App's.
    assert report["inference_port"] in generators and report["inference_port"] in reached
    assert reached <= generators | {report["own_port"]}, {
        name: port for name, port in internals.items() if port in reached
    } or report["reached"]
    assert report["own_port"] in reached
    assert len(report["refused"]) >= len(internals)
    for answered in report["answered"].values():
        assert answered["kafka"].startswith("failed"), report["answered"]
    for read in ("job_events", "trajectories", "learner_group"):
        assert report[read].startswith("failed"), (read, report[read])
    for url in ("weights", "vault"):
        assert not isinstance(report[url], int), (url, report[url])
