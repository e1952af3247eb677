"""Kafka over TLS on a node: where its CA and each party's certificate live, and how hosts
that join it get theirs.

Under `<data dir>/secrets/kafka/` (0700, every file 0600): `ca/` (the node's CA, made once
by the control host), `front/` (the TLS front's server certificate, issued again at each
start for the address it listens on) and one directory per client: each service the host
runs, the node's own operator client (`rlnode-operator`: topics, the node's tools) and
whatever `rlnode kafka-cert NAME` issued. A host that joins gets its services' certificates
and the CA in the join file, beside their service tokens; it never holds the CA's key.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rlnode.bus.pki import Identity, Issued, NodeCA, write_identity

OPERATOR = "rlnode-operator"
FRONT = "kafka-front"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,99}$")


class KafkaTlsError(RuntimeError):
    pass


def kafka_secrets(data_dir: Path) -> Path:
    return data_dir / "secrets" / "kafka"


def node_ca(data_dir: Path, create: bool = True) -> NodeCA:
    directory = kafka_secrets(data_dir) / "ca"
    if not create and not (directory / "ca.key").exists():
        raise KafkaTlsError(
            f"no Kafka CA under {directory}: it is made by the control host of a node whose "
            "broker has a TLS front (rlnode up --host ADDRESS, or --kafka-tls); run this there"
        )
    return NodeCA.ensure(directory)


def check_name(name: str) -> str:
    if not NAME.match(name) or name in ("ca", "front"):
        raise KafkaTlsError(
            f"certificate name {name!r}: 1-100 letters, digits and . _ @ -, starting with a "
            "letter or digit (not 'ca' or 'front')"
        )
    return name


def client_identity(data_dir: Path, name: str, ca: NodeCA | None = None) -> Identity:
    """`name`'s client certificate under the data dir, issued by the node's CA on first use."""
    directory = kafka_secrets(data_dir) / check_name(name)
    identity = Identity(directory / "ca.pem", directory / f"{name}.pem", directory / f"{name}.key")
    if all(p.exists() for p in (identity.ca, identity.cert, identity.key)):
        return identity
    return (ca or node_ca(data_dir)).write_identity(directory, name)


def existing_identity(data_dir: Path, name: str) -> Identity | None:
    """`name`'s certificate under the data dir if it was issued, without issuing one."""
    directory = kafka_secrets(data_dir) / name
    identity = Identity(directory / "ca.pem", directory / f"{name}.pem", directory / f"{name}.key")
    return identity if all(p.exists() for p in (identity.ca, identity.cert, identity.key)) else None


def front_identity(data_dir: Path, addresses: tuple[str, ...]) -> Identity:
    """The front's server certificate, for the addresses clients reach it at."""
    return node_ca(data_dir).write_identity(kafka_secrets(data_dir) / "front", FRONT, addresses)


def join_payload(data_dir: Path, services: tuple[str, ...]) -> dict[str, Any]:
    """What the join file carries for the joining hosts' services: the CA's certificate and a
    client certificate and key for each (never the CA's key)."""
    certs = {}
    for service in services:
        identity = client_identity(data_dir, service)
        certs[service] = {
            "cert": identity.cert.read_text(),
            "key": identity.key.read_text(),
        }
    return {"ca": node_ca(data_dir).cert_pem.decode(), "certs": certs}


def identities_from_join(data_dir: Path, payload: dict[str, Any]) -> dict[str, Identity]:
    """The joining host's copies (0600, under its own data dir) of what the join file carries."""
    try:
        ca = payload["ca"].encode()
        return {
            service: write_identity(
                kafka_secrets(data_dir) / check_name(service),
                service,
                Issued(pair["cert"].encode(), pair["key"].encode()),
                ca,
            )
            for service, pair in payload["certs"].items()
        }
    except (KeyError, TypeError, AttributeError) as e:
        raise KafkaTlsError(
            f"the join file's kafka_tls entry is not one rlnode wrote ({e!r}): write it again "
            "on the control host"
        ) from None
