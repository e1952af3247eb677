"""A node's Kafka credentials under its data directory, and what a joining host gets of them.

Under `<data dir>/secrets/kafka/` (0700, every file 0600): `ca/` (the node's CA, made once by
the control host), `broker/` (the broker's certificate, issued again at each start for the
addresses it listens on; its common name is what the controller listener lets in) and
`users.json` (a SCRAM password per Kafka user: each service, the admin, each org that was
given credentials for a Kafka client of its own: `grant_org`, `rlnode kafka-credentials`). A host that joins gets its services' users and the CA's certificate in the
join file, beside their service tokens; it never holds the CA's key or the admin's password.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlnode.bus.acls import grant, org_acls, org_user
from rlnode.bus.clients import ensure_topics, replication_of
from rlnode.bus.pki import Identity, NodeCA
from rlnode.bus.principals import BROKER_CERT_NAME, KafkaUser, UserStore, check_user_name
from rlnode.bus.settings import KafkaSettings
from rlnode.messages import topics
from rlnode.service.files import private_dir, write_private

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,99}$")


class KafkaAccessError(RuntimeError):
    pass


def kafka_secrets(data_dir: Path) -> Path:
    return data_dir / "secrets" / "kafka"


def ca_certificate(data_dir: Path) -> Path:
    """The node's CA certificate: what every client checks the brokers' certificates with."""
    return kafka_secrets(data_dir) / "ca" / "ca.pem"


def node_ca(data_dir: Path, create: bool = True) -> NodeCA:
    directory = kafka_secrets(data_dir) / "ca"
    if not create and not (directory / "ca.key").exists():
        raise KafkaAccessError(
            f"no Kafka CA under {directory}: it is made by the node's control host (rlnode "
            "up) or, for production compose, by rlnode kafka-cert --init-ca; run this there"
        )
    return NodeCA.ensure(directory)


def check_name(name: str) -> str:
    if not NAME.match(name) or name in ("ca", "broker"):
        raise KafkaAccessError(
            f"certificate name {name!r}: 1-100 letters, digits and . _ @ -, starting with a "
            "letter or digit (not 'ca' or 'broker')"
        )
    return name


def broker_identity(data_dir: Path, addresses: tuple[str, ...]) -> Identity:
    """The broker's certificate for the addresses clients and the other controllers reach it
    at (issued anew at each start: the addresses may change)."""
    return node_ca(data_dir).write_identity(
        kafka_secrets(data_dir) / "broker", BROKER_CERT_NAME, addresses
    )


def users(data_dir: Path) -> UserStore:
    return UserStore.of_node(data_dir)


def join_payload(data_dir: Path, services: tuple[str, ...], ca_pem: bytes) -> dict[str, Any]:
    """What the join file carries for the joining host's services: the certificate of the
    CA that signed the brokers' and each service's Kafka user (never the CA's key, nor the
    admin's password)."""
    return {
        "ca": ca_pem.decode(),
        "users": {user.name: user.password for user in users(data_dir).users(list(services))},
    }


def credentials_from_join(data_dir: Path, payload: dict[str, Any]) -> dict[str, KafkaUser]:
    """The joining host's copies (0600, under its own data dir) of what the join file
    carries: the CA's certificate, and its services' users."""
    try:
        ca = payload["ca"].encode()
        joined = {
            check_user_name(name): KafkaUser(name, str(password))
            for name, password in payload["users"].items()
        }
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise KafkaAccessError(
            f"the join file's kafka entry is not one rlnode wrote ({e!r}): write it again "
            "on the control host"
        ) from None
    private_dir(ca_certificate(data_dir).parent)
    write_private(ca_certificate(data_dir), ca)
    return joined


@dataclass(frozen=True)
class OrgKafkaAccess:
    """What an org's users get for a Kafka client of their own."""

    org_id: str
    user: KafkaUser
    events_topic: str  # where its job events are copied
    group_prefix: str  # the consumer groups it may join are named so

    def client_settings(self, bootstrap: str, ca: Path) -> KafkaSettings:
        return self.user.client_settings(bootstrap, ca)


async def grant_org(
    admin: KafkaSettings, data_dir: Path, org_id: str, rotate: bool = False
) -> OrgKafkaAccess:
    """The org's Kafka user (made, or given a new password with `rotate`), its own events
    topic, and its ACLs (rlnode.bus.acls.org_acls), made through `admin`'s login. The
    password is kept with the node's other Kafka users, so asking again gives the same."""
    store = users(data_dir)
    name = org_user(org_id)
    if rotate:
        store.forget(name)
    user = store.user(name)
    events = topics.org_events(org_id)
    # One partition: an org's events are few, and its users read them in one order. As
    # many replicas as the node's own job events (three on a cluster), whatever KAFKA_*
    # the operator's shell has.
    replicas = await replication_of(admin, topics.JOB_EVENTS)
    await ensure_topics(admin, [events], partitions=1, replication_factor=replicas)
    await grant(admin, [user], org_acls(org_id))
    return OrgKafkaAccess(org_id, user, events, topics.org_prefix(org_id))
