"""Real service processes for tests that need several of them: a vault, a gateway, rollout
generators, with the tokens each needs."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition

from rlnode.bus.clients import topic_partitions
from rlnode.bus.localbroker import free_port
from rlnode.bus.settings import KafkaSettings
from rlnode.bus.signing import RecordSigner
from rlnode.messages import topics
from rlnode.node.processes import ServiceProcess
from rlnode.service.registry import SERVICES_BY_NAME
from rlnode.testing import unique_id
from tests.integration.vault_fixtures import RunningVault

# A rollout-generator on vLLM's CPU build: fp32 (the tests compare with fp32 forward passes)
# and a small KV cache (several engines share this machine's memory).
VLLM_ON_THE_CPU = {
    "GENERATOR_ENGINE": "vllm",
    "GENERATOR_DTYPE": "float32",
    "GENERATOR_CPU_KV_CACHE_MIB": "256",
    # Engines up in about half the time. The compiled path (vLLM's default) is the
    # conformance suite's tiny-qwen2 case.
    "GENERATOR_ENFORCE_EAGER": "true",
}


async def work_group_at_the_end(bootstrap: str) -> str:
    """A consumer group of the caller's own that starts where the work topic ends now: no
    earlier test's work to redo (work of other models, of jobs that never ended), and no
    earlier test's members or failures to inherit."""
    group = unique_id("gen")
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        numbers = await topic_partitions(
            KafkaSettings(bootstrap_servers=bootstrap), topics.ROLLOUT_WORK
        )
        partitions = [TopicPartition(topics.ROLLOUT_WORK, p) for p in numbers]
        consumer.assign(partitions)
        await consumer.commit(await consumer.end_offsets(partitions))
    finally:
        await consumer.stop()
    return group


@dataclass
class Stack:
    directory: Path
    vault: RunningVault
    gateway: ServiceProcess
    org_id: str
    org_token: str
    key: str
    generator_token: str
    operator_token: str
    processes: list[ServiceProcess] = field(default_factory=list)

    @property
    def checkpoint_store(self) -> Path:
        """The store the stack's services share (RLNODE_CHECKPOINT_DIR)."""
        return self.directory / "checkpoints"

    def generator(self, name: str, kafka_bootstrap: str, **env: str) -> ServiceProcess:
        process = ServiceProcess(
            SERVICES_BY_NAME["rollout-generator"],
            free_port(),
            self.directory / f"generator-{name}.log",
            env={
                "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
                "KAFKA_SESSION_TIMEOUT_MS": "6000",
                "KAFKA_HEARTBEAT_INTERVAL_MS": "2000",
                "GENERATOR_GATEWAY_URL": self.gateway.url,
                "GENERATOR_VAULT_URL": self.vault.url,
                "GENERATOR_SERVICE_TOKEN": self.generator_token,
                "GENERATOR_GENERATOR_ID": name,
                "GENERATOR_MAX_WAIT_MS": "2",
                "RLNODE_DATA_DIR": str(self.directory / f"generator-{name}"),
                "RLNODE_CHECKPOINT_DIR": str(self.checkpoint_store),
                **env,
            },
        ).start()
        self.processes.append(process)
        return process

    def learner_token(self) -> str:
        """The learner's service token, with the scopes the service registry gives it."""
        learner = SERVICES_BY_NAME["learner"]
        return self.vault.service_token(list(learner.token_scopes), service=learner.name)

    def signer(self, service: str) -> RecordSigner:
        """A record signer certified as `service`: for a test that publishes what that
        service would (work and weight versions as the learner, say)."""
        token = self.vault.service_token(["records:sign"], service=service)
        return RecordSigner(self.vault.url, token)

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.gateway.stop()
        self.vault.stop()


def start_stack(directory: Path, **gateway_env: str) -> Stack:
    """A vault with one org whose ENVIRONMENT_API_KEY is set, and a gateway that can unseal it."""
    vault = RunningVault(f"sqlite:///{directory / 'vault.sqlite3'}", directory / "vault").start()
    org_id, org_token = vault.new_org()
    key = "tk-" + secrets.token_hex(16)
    with vault.client(org_token) as org:
        org.set_secret("ENVIRONMENT_API_KEY", key)
    gateway = ServiceProcess(
        SERVICES_BY_NAME["taskapp-gateway"],
        free_port(),
        directory / "gateway.log",
        env={
            "GATEWAY_VAULT_URL": vault.url,
            "GATEWAY_SERVICE_TOKEN": vault.service_token(["secrets:unseal"]),
            "DATABASE_URL": f"sqlite:///{directory / 'gateway.sqlite3'}",
            "RLNODE_DATA_DIR": str(directory / "gateway-data"),
            "GATEWAY_HEALTH_INTERVAL_S": "0.5",
            "GATEWAY_RESTART_BACKOFF_S": "0.2",
            "GATEWAY_CONNECT_RETRIES": "2",
            "GATEWAY_ALLOW_URLS_TO": '["loopback"]',  # the Task Apps here run on loopback
            **gateway_env,
        },
    ).start()
    gateway.wait_healthy()
    return Stack(
        directory=directory,
        vault=vault,
        gateway=gateway,
        org_id=org_id,
        org_token=org_token,
        key=key,
        generator_token=vault.service_token(
            ["rollouts:run", "records:sign"], service="rollout-generator"
        ),
        operator_token=vault.service_token(["node:ops"], service="operator"),
    )
