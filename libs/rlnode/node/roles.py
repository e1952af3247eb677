"""Roles per host: a node can span machines, each running the services of its roles.

- `control`: the broker (embedded unless KAFKA_BOOTSTRAP_SERVERS names one), the vault, the
  taskapp-gateways (with the managed Task Apps) and the tinker-api. One host has it.
- `training`: the learner, and the checkpoint-server beside it (it serves the checkpoints
  the learner writes to its own disk).
- `inference`: rollout-generators. They load weight versions from the learner's shared
  memory when they share its host, else over HTTP from the learner (GENERATOR_WEIGHTS_URL).

The control host writes a join file (`<data dir>/join.json`, mode 600): where the broker,
the vault, the gateways and (when it trains too) the learner answer, and a service token for
each service another host runs. An operator copies it to the other hosts, as one copies a
cluster's join token; `rlnode up --role inference --join join.json` needs nothing else."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlnode.service.files import private_file
from rlnode.service.registry import (
    CHECKPOINT_SERVER,
    GATEWAY,
    GENERATOR,
    LEARNER,
    TINKER_API,
    VAULT,
)

ROLES: dict[str, tuple[str, ...]] = {
    "control": (VAULT.name, GATEWAY.name, TINKER_API.name),
    "training": (LEARNER.name, CHECKPOINT_SERVER.name),
    "inference": (GENERATOR.name,),
}
ALL_ROLES = tuple(ROLES)
# Services another host may run with the control host's join file (the control host's own
# mint their tokens from the vault's admin token).
JOINING_SERVICES = (LEARNER.name, CHECKPOINT_SERVER.name, GENERATOR.name)


class RoleError(ValueError):
    pass


def parse_roles(text: str) -> tuple[str, ...]:
    """`control,training` -> ("control", "training"); unknown or repeated names refused."""
    roles = tuple(r.strip() for r in text.split(",") if r.strip())
    unknown = [r for r in roles if r not in ROLES]
    if unknown or not roles:
        raise RoleError(
            f"unknown role(s) {', '.join(unknown) or '(none given)'}: give a comma list of "
            f"{', '.join(ALL_ROLES)}"
        )
    if len(set(roles)) != len(roles):
        raise RoleError(f"a role is named twice in {text!r}")
    return tuple(r for r in ALL_ROLES if r in roles)


def services_of(roles: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(name for role in roles for name in ROLES[role])


@dataclass(frozen=True)
class JoinInfo:
    """What a host needs to join the control host's node."""

    bootstrap: str
    vault_url: str
    gateway_urls: list[str]
    service_tokens: dict[str, str]
    learner_url: str = ""  # where generators fetch weight versions ("" if not known yet)
    checkpoint_server_url: str = ""
    # Where rank hosts join the learner (`rlnode trainer-ranks --join join.json`; "" when
    # the host that writes it runs no learner with rank hosts).
    rendezvous: str = ""
    # Kafka: the node's CA certificate (the brokers' certificates are its) and a Kafka user
    # per joining service (rlnode.node.kafka_access); {} for a broker of the user's own.
    kafka: dict = field(default_factory=dict)
    version: int = 2
    comment: str = field(
        default="rlnode join file: service tokens inside; keep it private (mode 600)"
    )

    def token_for(self, service: str) -> str:
        try:
            return self.service_tokens[service]
        except KeyError:
            raise RoleError(
                f"the join file has no service token for {service}: write it again on the "
                "control host (rlnode up --role control ... writes <data dir>/join.json)"
            ) from None

    def write(self, path: Path) -> Path:
        tmp = private_file(path.with_suffix(".tmp"))
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)
        return path

    @classmethod
    def read(cls, path: Path) -> JoinInfo:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise RoleError(
                f"no join file at {path}: copy <data dir>/join.json from the control host"
            ) from None
        except json.JSONDecodeError as e:
            raise RoleError(f"{path} is not a join file (not JSON: {e})") from None
        try:
            return cls(**raw)
        except TypeError as e:
            raise RoleError(f"{path} is not a join file this rlnode reads: {e}") from None


def join_path(data_dir: Path) -> Path:
    return data_dir / "join.json"
