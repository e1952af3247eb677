"""The six services, declared once: name, package, default port, health path, the scopes
of the service token each needs, its settings prefix, and the variable clients read its URL
from. The settings defaults, the SDK's default URLs, the CLI's help, the node's process
wiring, the supervisor and the compose emitter all read this table."""

from __future__ import annotations

from dataclasses import dataclass

from rlnode.service.auth import Scope

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ServiceSpec:
    name: str  # "taskapp-gateway": process, log file, compose service and token subject
    package: str  # `python -m <package>` runs it
    port: int  # default HTTP port; the node offsets it from --port-base
    env_prefix: str  # its settings: <PREFIX>PORT, <PREFIX>HOST, ...
    token_scopes: tuple[Scope, ...] = ()  # what its node-wide service token may do
    client_url_env: str | None = None  # where the CLI and SDK read its URL
    health_path: str = "/health"
    # It reads and writes Kafka topics: it logs in to the broker as a Kafka user of its own.
    on_the_bus: bool = False

    @property
    def default_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def url_in(self, host: str) -> str:
        """Its URL on another host at its default port (compose service names)."""
        return f"http://{host}:{self.port}"


VAULT = ServiceSpec(
    "credential-vault",
    "rlnode_services.credential_vault",
    8710,
    "VAULT_",
    client_url_env="RLNODE_VAULT_URL",
)
GATEWAY = ServiceSpec(
    "taskapp-gateway",
    "rlnode_services.taskapp_gateway",
    8720,
    "GATEWAY_",
    token_scopes=(Scope.SECRETS_UNSEAL,),
    client_url_env="RLNODE_GATEWAY_URL",
)
GENERATOR = ServiceSpec(
    "rollout-generator",
    "rlnode_services.rollout_generator",
    8730,
    "GENERATOR_",
    token_scopes=(Scope.ROLLOUTS_RUN, Scope.RECORDS_SIGN, Scope.WEIGHTS_READ),
    on_the_bus=True,
)
LEARNER = ServiceSpec(
    "learner",
    "rlnode_services.learner",
    8740,
    "LEARNER_",
    token_scopes=(Scope.TASKAPPS_READ, Scope.SECRETS_READ, Scope.RECORDS_SIGN),
    on_the_bus=True,
)
CHECKPOINT_SERVER = ServiceSpec(
    "checkpoint-server",
    "rlnode_services.checkpoint_server",
    8750,
    "CHECKPOINT_SERVER_",
    token_scopes=(Scope.RECORDS_SIGN, Scope.WEIGHTS_READ),
    client_url_env="RLNODE_CHECKPOINT_URL",
    on_the_bus=True,
)

TINKER_API = ServiceSpec(
    "tinker-api",
    "rlnode_services.tinker_api",
    8760,
    "TINKER_API_",
    # It signs the calls it publishes, and asks generators to sample (their tinker route).
    token_scopes=(Scope.RECORDS_SIGN, Scope.TINKER),
    # What the tinker SDK reads its server from.
    client_url_env="TINKER_BASE_URL",
    on_the_bus=True,
)

# In start order: each after what it needs.
SERVICES: tuple[ServiceSpec, ...] = (
    VAULT,
    GATEWAY,
    GENERATOR,
    LEARNER,
    CHECKPOINT_SERVER,
    TINKER_API,
)
SERVICES_BY_NAME = {s.name: s for s in SERVICES}
PORT_BASE = VAULT.port
MAX_GATEWAYS = 10  # a node's gateways take the ports from the gateway's to the generators'


def port_offset(spec: ServiceSpec) -> int:
    """Where it sits in a node's block of ports (`rlnode up --port-base`)."""
    return spec.port - PORT_BASE
