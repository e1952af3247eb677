"""Who is who on the node's Kafka: a SCRAM-SHA-512 user per service, the operator's admin
user, and the brokers' own certificate; their passwords, kept under the data directory.

Every client authenticates with SCRAM-SHA-512 over TLS (the broker's certificate is signed by
the node's CA, rlnode.bus.pki). The admin user is the node's operator and the brokers' own
inter-broker user, a super user like the brokers' certificate, which is the only way onto
the controller listener (mTLS: KRaft keeps SCRAM credentials in the metadata log, so the
controllers cannot check a SCRAM login among themselves). What each user may do is the ACLs
of rlnode.bus.acls, deny-by-default.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlnode.bus.settings import KafkaSettings
from rlnode.service.files import private_dir, write_private

MECHANISM = "SCRAM-SHA-512"
# The operator, topic creation and ACLs, and the brokers among themselves: a super user.
ADMIN = "admin"
# The common name of every broker's certificate: what the controller listener lets in.
BROKER_CERT_NAME = "rlnode-broker"
# A Kafka user name rlnode makes: a service's, an org's (org-<id>: ids are up to 128), the
# admin.
USER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,139}$")


class PrincipalError(RuntimeError):
    pass


@dataclass(frozen=True)
class KafkaUser:
    name: str
    password: str

    @property
    def principal(self) -> str:
        return f"User:{self.name}"

    def client_settings(self, bootstrap: str, ca: Path, **fields: Any) -> KafkaSettings:
        """The settings of a client logged in as this user, over TLS to the brokers at
        `bootstrap` whose certificates `ca` signed (`fields`: any other setting)."""
        return KafkaSettings.model_validate(
            {
                "bootstrap_servers": bootstrap,
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": MECHANISM,
                "sasl_username": self.name,
                "sasl_password": self.password,
                "ssl_cafile": ca,
                **fields,
            }
        )

    def client_env(self, bootstrap: str, ca: Path) -> dict[str, str]:
        """The same as KAFKA_* environment variables, for a process of its own."""
        return self.client_settings(bootstrap, ca).connection_env()


def check_user_name(name: str) -> str:
    if not USER_NAME.match(name):
        raise PrincipalError(
            f"Kafka user name {name!r}: 1-140 letters, digits and . _ @ -, starting with a "
            "letter or digit"
        )
    return name


class UserStore:
    """The node's Kafka users and their passwords, in one 0600 JSON file under its secrets:
    each made (a random 256-bit password) the first time it is asked for and kept."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def of_node(cls, data_dir: Path) -> UserStore:
        return cls(data_dir / "secrets" / "kafka" / "users.json")

    def _read(self) -> dict[str, str]:
        try:
            stored = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise PrincipalError(
                f"cannot read the node's Kafka users in {self.path} ({e}): run this as the "
                "user that runs the node"
            ) from e
        return {str(k): str(v) for k, v in stored.items()}

    def _write(self, users: dict[str, str]) -> None:
        private_dir(self.path.parent)
        write_private(self.path, json.dumps(users, indent=2, sort_keys=True).encode())

    def user(self, name: str) -> KafkaUser:
        return self.users([name])[0]

    def users(self, names: list[str] | tuple[str, ...]) -> list[KafkaUser]:
        stored = self._read()
        missing = [check_user_name(n) for n in names if n not in stored]
        if missing:
            stored |= {name: secrets.token_urlsafe(32) for name in missing}
            self._write(stored)
        return [KafkaUser(name, stored[name]) for name in names]

    def existing(self, name: str) -> KafkaUser | None:
        password = self._read().get(name)
        return KafkaUser(name, password) if password is not None else None

    def forget(self, name: str) -> None:
        stored = self._read()
        if stored.pop(name, None) is not None:
            self._write(stored)
