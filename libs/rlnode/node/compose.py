"""Compose files for a node over several hosts, one per role (`deploy/compose/`): the
control host runs Kafka, PostgreSQL, the vault, the gateway and the tinker-api; a training host the learner
and the checkpoint-server; an inference host a rollout-generator per engine. Each file
carries its role's plan for 8 GPUs (`make_plan(8, roles=(role,))`); `rlnode plan --role R
--gpus N --emit compose` writes the override for another count from the same function
(`role_gpu_services`), so GPU reservations are written in one place.

A host reaches the others at RLNODE_CONTROL_HOST and RLNODE_TRAINING_HOST, and publishes its
own ports on its address (RLNODE_INFERENCE_HOST on an inference host); every use is
`${VAR:?...}`, so compose refuses to start without them. A generator on an inference host is
named and called back at its host's address (gen3@10.0.0.7, http://10.0.0.7:8733: a
published port each) and keeps the weight versions it downloads from the learner
(GENERATOR_WEIGHTS_URL) in a directory of its own."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

import yaml

from rlnode.bus.acls import Acl
from rlnode.bus.principals import ADMIN, MECHANISM
from rlnode.node.plan import BASE_COMPOSE_GENERATORS, GpuPlan, compose_gpu_services
from rlnode.service.registry import GENERATOR

ROLE_FILE_GPUS = 8  # deploy/compose/<role>.yaml carry the role's plan for 8 GPUs
ROLE_FILES = {role: f"deploy/compose/{role}.yaml" for role in ("control", "training", "inference")}
HOST_VARIABLES = {
    "control": ("RLNODE_CONTROL_HOST", "the control host's address"),
    "training": ("RLNODE_TRAINING_HOST", "the training host's address"),
    "inference": ("RLNODE_INFERENCE_HOST", "this inference host's address"),
}
# A tmpfs volume on an inference host, shared by its generators: one download per version
# per host, each generator's links under generators/<its id> (rollout_generator/fetch.py).
FETCHED_WEIGHTS_DIR = PurePosixPath("/var/lib/rlnode-fetched")


def host(role: str) -> str:
    """The compose interpolation of the address of the host with `role`."""
    variable, what = HOST_VARIABLES[role]
    return f"${{{variable}:?{what}}}"


def generator_port(index: int) -> int:
    """The port generator `index` is published on at its host's address (as `rlnode up`
    numbers them: the generator's port, plus its index)."""
    return GENERATOR.port + index


def generator_on_host(index: int) -> dict[str, str]:
    """A generator's identity on an inference host: its name, the URL Task Apps call back,
    the directory of the weight versions it downloads (the host's, shared)."""
    name, prefix = f"gen{index}", GENERATOR.env_prefix
    return {
        f"{prefix}GENERATOR_ID": f"{name}@{host('inference')}",
        f"{prefix}PUBLIC_URL": f"http://{host('inference')}:{generator_port(index)}",
        f"{prefix}WEIGHTS_DIR": str(FETCHED_WEIGHTS_DIR),
    }


def role_gpu_services(plan: GpuPlan) -> dict[str, dict]:
    """The GPU-bearing services of a host's compose file: compose.yaml's for a host with
    both inference and training, else those of its role's file in deploy/compose/."""
    if plan.runs_inference and plan.runs_training:
        return compose_gpu_services(plan)
    services = compose_gpu_services(plan, base_generators=ROLE_FILE_GPUS)
    for index in range(len(plan.engines)):
        services[f"{GENERATOR.name}-{index}"]["environment"].update(generator_on_host(index))
    return services


class Replacing(list):
    """A sequence that replaces the base file's (Compose's `!override` tag, Compose v2.24 and
    later): Compose appends sequences, so an override's GPU reservation would otherwise add
    to the base file's 8-GPU one."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(Replacing, lambda d, data: d.represent_sequence("!override", data))


def _replacing_reservations(services: dict[str, dict]) -> dict[str, dict]:
    for service in services.values():
        reservations = service.get("deploy", {}).get("resources", {}).get("reservations")
        if reservations is not None:
            reservations["devices"] = Replacing(reservations["devices"])
    return services


def override(plan: GpuPlan, command: str) -> str:
    """The override `rlnode plan ... --emit compose` prints for this host's plan."""
    if plan.runs_inference and plan.runs_training:
        base, generators = "compose.yaml", BASE_COMPOSE_GENERATORS
    else:
        role = "inference" if plan.runs_inference else "training"
        base, generators = ROLE_FILES[role], ROLE_FILE_GPUS
    header = (
        f"# GPU overrides for {plan.visible} GPU(s), from `{command}`.\n"
        f"# docker compose -f {base} -f THIS_FILE up -d\n"
        "# (Compose v2.24 or later: `!override` replaces the base file's GPU reservations)\n"
    )
    services = _replacing_reservations(role_gpu_services(plan))
    body = yaml.dump({"services": services}, Dumper=_Dumper, sort_keys=False, width=200)
    if len(plan.engines) > generators:
        last = f"{GENERATOR.name}-{generators - 1}"
        ports = "" if base == "compose.yaml" else " (each with a port of its own)"
        body += f"# more than {generators} engines: copy {last} in {base} for the rest{ports}\n"
    return header + body


# -- Kafka in production compose: SASL_SSL (SCRAM), one user per service, ACLs ----------
#
# The brokers' settings are the node's own broker's (rlnode.bus.localbroker's
# cluster_properties and secured_properties), written as the apache/kafka image's
# variables: compose's brokers and `rlnode up`'s cannot drift apart.

# The image of the Kafka version `make setup` fetches (deploy/kafka/pom.xml; a test checks).
KAFKA_IMAGE = "apache/kafka:4.4.0"
# compose.yaml: three combined brokers and controllers, replication 3, min.insync.replicas 2.
KAFKA_BROKERS = ("kafka-1", "kafka-2", "kafka-3")
KAFKA_PORT = 9092
KAFKA_CONTROLLER_PORT = 9093
KAFKA_DATA = "/var/lib/kafka/data"
# Users: each service that is on the bus, the admin (the brokers log in to each other as
# it; topics, users and ACLs) and `rlnode-jobs`, for users who start jobs with a Kafka
# client of their own.
KAFKA_ADMIN = ADMIN
KAFKA_JOBS_USER = "rlnode-jobs"
KAFKA_CA_SECRET = "/run/secrets/kafka-ca"
KAFKA_KEYSTORE_SECRET = "/run/secrets/kafka-keystore"
# The admin's password for the brokers' health check and storage format (an RLNODE_
# variable: the image turns every KAFKA_ one into a setting).
ADMIN_PASSWORD_ENV = "RLNODE_KAFKA_ADMIN_PASSWORD"
CLUSTER_ID_VARIABLE = "KAFKA_CLUSTER_ID"


def kafka_password_variable(user: str) -> str:
    return f"KAFKA_{user.upper().replace('-', '_')}_PASSWORD"


def kafka_users() -> tuple[str, ...]:
    from rlnode.messages import topics

    return (KAFKA_ADMIN, *sorted(topics.READERS), KAFKA_JOBS_USER)


def _password(user: str) -> str:
    variable = kafka_password_variable(user)
    return f"${{{variable}:?set {variable} (a random password for Kafka user {user})}}"


def kafka_bootstrap(brokers: tuple[str, ...] = KAFKA_BROKERS) -> str:
    return ",".join(f"{name}:{KAFKA_PORT}" for name in brokers)


def kafka_voters(brokers: tuple[str, ...] = KAFKA_BROKERS) -> str:
    return ",".join(f"{i}@{name}:{KAFKA_CONTROLLER_PORT}" for i, name in enumerate(brokers, 1))


def image_variable(setting: str) -> str:
    """The apache/kafka image's variable for a broker setting: `.` is `_`, `_` is `__` and
    `-` is `___` (listener.name.broker.scram-sha-512.sasl.jaas.config ->
    KAFKA_LISTENER_NAME_BROKER_SCRAM___SHA___512_SASL_JAAS_CONFIG)."""
    return "KAFKA_" + setting.replace("_", "__").replace("-", "___").replace(".", "_").upper()


def image_setting(variable: str) -> str:
    """The inverse: what the image makes of a KAFKA_ variable."""
    name = variable.removeprefix("KAFKA_").lower()
    return name.replace("___", "-").replace("__", "\0").replace("_", ".").replace("\0", "_")


def kafka_broker_env(
    node_id: int,
    *,
    listeners: str,
    advertised: str,
    voters: str,
    protocols: str,
    sasl_listeners: tuple[str, ...],
    inter_broker: str,
    replication: int,
) -> dict[str, str]:
    """A compose broker's environment: its settings (the node's broker's, from
    rlnode.bus.localbroker) as the image's variables, the cluster id, and the admin's
    password for its health check and format step."""
    from rlnode.bus.localbroker import cluster_properties, kraft_properties, secured_properties
    from rlnode.bus.settings import DEFAULT_MAX_MESSAGE_BYTES

    settings = {
        **kraft_properties(node_id, voters, listeners, advertised, inter_broker),
        "listener.security.protocol.map": protocols,
        "log.dirs": KAFKA_DATA,
        **cluster_properties(replication, DEFAULT_MAX_MESSAGE_BYTES),
        **secured_properties(
            KAFKA_ADMIN,
            _password(KAFKA_ADMIN),
            KAFKA_KEYSTORE_SECRET,
            KAFKA_CA_SECRET,
            sasl_listeners,
        ),
    }
    # A `$` of the settings' own (a principal mapping rule's) is escaped; `${...}` is
    # compose's interpolation (a password, a host's address), left to it.
    env = {image_variable(key): re.sub(r"\$(?!\{)", "$$", v) for key, v in settings.items()}
    variable = CLUSTER_ID_VARIABLE
    env["CLUSTER_ID"] = f"${{{variable}:?set {variable} (rlnode kafka-cluster-id)}}"
    env[ADMIN_PASSWORD_ENV] = _password(KAFKA_ADMIN)
    return env


def one_node_brokers() -> dict[int, dict[str, str]]:
    """compose.yaml's brokers (by node id): one listener for clients and brokers, the
    controllers on the compose network, mTLS between them."""
    return {
        node_id: kafka_broker_env(
            node_id,
            listeners=f"BROKER://:{KAFKA_PORT},CONTROLLER://:{KAFKA_CONTROLLER_PORT}",
            advertised=f"BROKER://{name}:{KAFKA_PORT}",
            voters=kafka_voters(),
            protocols="BROKER:SASL_SSL,CONTROLLER:SSL",
            sasl_listeners=("broker",),
            inter_broker="BROKER",
            replication=len(KAFKA_BROKERS),
        )
        for node_id, name in enumerate(KAFKA_BROKERS, 1)
    }


CONTROL_INTERNAL_PORT = 19092


def control_host_broker() -> dict[str, str]:
    """deploy/compose/control.yaml's one broker: the control host's services reach it on the
    compose network, the other hosts at the control host's address; its controller on the
    container's loopback."""
    return kafka_broker_env(
        1,
        listeners=(
            f"INTERNAL://:{CONTROL_INTERNAL_PORT},EXTERNAL://:{KAFKA_PORT},"
            f"CONTROLLER://127.0.0.1:{KAFKA_CONTROLLER_PORT}"
        ),
        advertised=(
            f"INTERNAL://kafka:{CONTROL_INTERNAL_PORT},EXTERNAL://{host('control')}:{KAFKA_PORT}"
        ),
        voters=f"1@127.0.0.1:{KAFKA_CONTROLLER_PORT}",
        protocols="INTERNAL:SASL_SSL,EXTERNAL:SASL_SSL,CONTROLLER:SSL",
        sasl_listeners=("internal", "external"),
        inter_broker="INTERNAL",
        replication=1,
    )


def _admin_properties(path: str) -> str:
    """A shell line writing the admin's client properties (SCRAM over TLS) to `path`."""
    return (
        f"printf 'security.protocol=SASL_SSL\\nsasl.mechanism={MECHANISM}\\n"
        f"ssl.truststore.type=PEM\\nssl.truststore.location={KAFKA_CA_SECRET}\\n"
        "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username=\\"{KAFKA_ADMIN}\\" password=\\"%s\\";\\n\' "$${ADMIN_PASSWORD_ENV}" > {path}'
    )


def kafka_health_check(server: str) -> list[str]:
    """A broker's health check: the admin asks it its API versions over SASL_SSL."""
    return [
        "CMD-SHELL",
        f"umask 077 && {_admin_properties('/tmp/health.properties')} && "
        f"/opt/kafka/bin/kafka-broker-api-versions.sh --bootstrap-server {server} "
        "--command-config /tmp/health.properties >/dev/null",
    ]


def kafka_format_variables(env: dict[str, str]) -> list[str]:
    """The variables of a broker's environment its format step writes as settings for
    kafka-storage.sh: all of its KAFKA_ ones less the JAAS lines (no password on disk; the
    format does not log in)."""
    return [name for name in env if name.startswith("KAFKA_") and "JAAS" not in name]


def kafka_format_settings(env: dict[str, str]) -> dict[str, str]:
    """What the format step writes for a broker with environment `env` (as compose gives
    it, `$$` still escaped)."""
    return {image_setting(name): env[name] for name in kafka_format_variables(env)}


def kafka_format_script(env: dict[str, str]) -> str:
    """A broker's storage format step (a one-shot container on its volume, before it
    starts, with its broker's environment): its settings from that environment, then
    kafka-storage.sh format with the admin's SCRAM credentials, which the brokers need in
    the metadata log before any of them is up to add them. The image's own start skips an
    already formatted log directory. One script for every broker: it names variables."""
    lines = "".join(
        f' "{image_setting(name)}=$${{{name}}}"' for name in kafka_format_variables(env)
    )
    scram = f"{MECHANISM}=[name={KAFKA_ADMIN},password=$${ADMIN_PASSWORD_ENV}]"
    return (
        "set -eu\n"
        "umask 077\n"
        f"printf '%s\\n'{lines} > /tmp/format.properties\n"
        "/opt/kafka/bin/kafka-storage.sh format --config /tmp/format.properties "
        f'--cluster-id "$$CLUSTER_ID" --add-scram "{scram}" --ignore-formatted\n'
    )


def kafka_client_env(user: str) -> dict[str, str]:
    """What a service's Kafka clients need (KafkaSettings): TLS to the brokers, its user."""
    return {
        "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "KAFKA_SASL_MECHANISM": MECHANISM,
        "KAFKA_SASL_USERNAME": user,
        "KAFKA_SASL_PASSWORD": _password(user),
        "KAFKA_SSL_CAFILE": KAFKA_CA_SECRET,
    }


def kafka_acls() -> list[Acl]:
    """Every permission a Kafka user gets: each service's (rlnode.bus.acls, from topics.py),
    and rlnode-jobs' writing job requests."""
    from rlnode.bus.acls import service_acls
    from rlnode.messages import topics

    jobs = [Acl(KAFKA_JOBS_USER, op, "topic", topics.JOB_REQUESTS) for op in ("Write", "Describe")]
    return sorted({*service_acls(), *jobs})
