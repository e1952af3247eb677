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

from pathlib import PurePosixPath

import yaml

from rlnode.bus.acls import Acl
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


# -- Kafka in production compose: SASL_SSL, one user per service, ACLs -------------------

# Kafka users: each service that is on the bus, the admin (the broker itself, topic
# creation, ACLs) and `rlnode-jobs`, for users who start jobs with a Kafka client of their own.
KAFKA_ADMIN = "admin"
KAFKA_JOBS_USER = "rlnode-jobs"
KAFKA_CA_SECRET = "/run/secrets/kafka-ca"


def kafka_password_variable(user: str) -> str:
    return f"KAFKA_{user.upper().replace('-', '_')}_PASSWORD"


def kafka_users() -> tuple[str, ...]:
    from rlnode.messages import topics

    return (KAFKA_ADMIN, *sorted(topics.READERS), KAFKA_JOBS_USER)


def _password(user: str) -> str:
    variable = kafka_password_variable(user)
    return f"${{{variable}:?set {variable} (a random password for Kafka user {user})}}"


def kafka_jaas() -> str:
    """The broker's SASL/PLAIN users (passwords interpolated from the environment)."""
    users = " ".join(f'user_{u}="{_password(u)}"' for u in kafka_users())
    return (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        f'username="{KAFKA_ADMIN}" password="{_password(KAFKA_ADMIN)}" {users};'
    )


def kafka_client_env(user: str) -> dict[str, str]:
    """What a service's Kafka clients need (KafkaSettings): TLS to the broker, its user."""
    return {
        "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "KAFKA_SASL_MECHANISM": "PLAIN",
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


def kafka_acl_script(bootstrap: str) -> str:
    """The shell script production compose's `kafka-acls` service runs (apache/kafka image)."""
    lines = [
        "set -eu",
        "umask 077",
        "printf 'security.protocol=SASL_SSL\\nsasl.mechanism=PLAIN\\n"
        f"ssl.truststore.type=PEM\\nssl.truststore.location={KAFKA_CA_SECRET}\\n"
        "sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required "
        f'username=\\"{KAFKA_ADMIN}\\" password=\\"%s\\";\\n\' "$$RLNODE_KAFKA_ADMIN_PASSWORD"'
        " > /tmp/admin.properties",
    ]
    for acl in kafka_acls():
        prefixed = " --resource-pattern-type prefixed" if acl.pattern == "prefixed" else ""
        lines.append(
            f"/opt/kafka/bin/kafka-acls.sh --bootstrap-server {bootstrap} --command-config "
            f"/tmp/admin.properties --add --allow-principal User:{acl.user} --operation "
            f"{acl.operation} --{acl.kind} {acl.name}{prefixed}"
        )
    return "\n".join(lines) + "\n"
