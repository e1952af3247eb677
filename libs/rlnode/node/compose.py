"""Compose files for a node over several hosts, one per role (`deploy/compose/`): the
control host runs Kafka, PostgreSQL, the vault and the gateway; a training host the learner
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
