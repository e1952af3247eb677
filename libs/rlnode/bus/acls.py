"""What each Kafka user may do, and the Admin API calls that say so to the brokers.

The brokers deny whatever no ACL allows (StandardAuthorizer, allow.everyone.if.no.acl.found
false). Each service's ACLs are generated from topics.py's READERS, PRODUCERS and GROUPS:
what it reads, what it writes, the groups it joins, nothing else. SCRAM users and ACLs go
to the brokers through confluent-kafka's AdminClient (aiokafka has neither call), the same
way for the embedded broker, compose's and a cluster of the user's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from rlnode.bus.errors import BusError
from rlnode.bus.principals import MECHANISM, KafkaUser
from rlnode.bus.settings import KafkaSettings
from rlnode.messages import topics

Operation = Literal["Read", "Write", "Describe", "Create"]
ResourceKind = Literal["topic", "group"]
Pattern = Literal["literal", "prefixed"]
SCRAM_ITERATIONS = 8192
ADMIN_TIMEOUT_S = 30.0


@dataclass(frozen=True, order=True)
class Acl:
    """`user` may `operation` the `kind` named `name` (or every one starting with it)."""

    user: str
    operation: Operation
    kind: ResourceKind
    name: str
    pattern: Pattern = "literal"


def service_acls() -> list[Acl]:
    """Every permission of every service's user, from topics.py."""
    acls: set[Acl] = set()
    for service, read in topics.READERS.items():
        for topic in read:
            acls |= {Acl(service, "Read", "topic", topic), Acl(service, "Describe", "topic", topic)}
        acls |= {Acl(service, "Read", "group", group) for group in topics.GROUPS[service]}
        written = {t for t, producers in topics.PRODUCERS.items() if service in producers}
        if service in topics.JOB_REQUEST_WRITERS:
            written.add(topics.JOB_REQUESTS)
        for topic in written:
            acls |= {
                Acl(service, "Write", "topic", topic),
                Acl(service, "Describe", "topic", topic),
            }
    # The learner makes each org's own topic before its first event; the copier writes every
    # org's (their names start so, and nothing else's does).
    everyone = topics.ORG_PREFIX
    acls |= {
        Acl(topics.LEARNER, op, "topic", everyone, "prefixed") for op in ("Create", "Describe")
    }
    copier = topics.ORG_EVENTS_COPIER
    acls |= {Acl(copier, op, "topic", everyone, "prefixed") for op in ("Write", "Describe")}
    return sorted(acls)


def org_user(org_id: str) -> str:
    """The Kafka user of an org's own clients."""
    return f"org-{org_id}"


def org_acls(org_id: str) -> list[Acl]:
    """What an org's user may do: write job requests (each carries a job token of the org's,
    which the learner checks), and read and join only what is the org's own: its topics and
    its consumer groups, all named under topics.org_prefix(org_id)."""
    user, own = org_user(org_id), topics.org_prefix(org_id)
    return sorted(
        {
            Acl(user, "Write", "topic", topics.JOB_REQUESTS),
            Acl(user, "Describe", "topic", topics.JOB_REQUESTS),
            Acl(user, "Read", "topic", own, "prefixed"),
            Acl(user, "Describe", "topic", own, "prefixed"),
            Acl(user, "Read", "group", own, "prefixed"),
        }
    )


def confluent_config(settings: KafkaSettings) -> dict[str, Any]:
    """librdkafka's configuration for the same connection KafkaSettings gives aiokafka."""
    config: dict[str, Any] = {
        "bootstrap.servers": settings.bootstrap_servers,
        "client.id": f"{settings.client_id_prefix}-admin",
    }
    if settings.security_protocol != "PLAINTEXT":
        config["security.protocol"] = settings.security_protocol.lower()
        if settings.ssl_cafile is not None:
            config["ssl.ca.location"] = str(settings.ssl_cafile)
        if settings.ssl_certfile is not None and settings.ssl_keyfile is not None:
            config["ssl.certificate.location"] = str(settings.ssl_certfile)
            config["ssl.key.location"] = str(settings.ssl_keyfile)
    if settings.security_protocol == "SASL_SSL":
        assert settings.sasl_password is not None
        config["sasl.mechanisms"] = settings.sasl_mechanism
        config["sasl.username"] = settings.sasl_username
        config["sasl.password"] = settings.sasl_password.get_secret_value()
    return config


def _binding(acl: Acl) -> Any:
    from confluent_kafka.admin import (
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    return AclBinding(
        ResourceType.TOPIC if acl.kind == "topic" else ResourceType.GROUP,
        acl.name,
        ResourcePatternType.PREFIXED if acl.pattern == "prefixed" else ResourcePatternType.LITERAL,
        f"User:{acl.user}",
        "*",
        AclOperation[acl.operation.upper()],
        AclPermissionType.ALLOW,
    )


def _wait_all(futures: dict[Any, Any], what: str, settings: KafkaSettings) -> None:
    failed = []
    for key, future in futures.items():
        try:
            future.result(timeout=ADMIN_TIMEOUT_S)
        except Exception as e:  # a KafkaException naming the broker's reason
            failed.append(f"{key}: {e}")
    if failed:
        user = settings.sasl_username or "(no user)"
        raise BusError(
            f"{what} on {settings.bootstrap_servers} as Kafka user {user} failed: "
            + "; ".join(failed[:5])
            + " (the node's admin user, a super user, makes users and ACLs)"
        )


def grant_sync(
    settings: KafkaSettings, users: Iterable[KafkaUser] = (), acls: Iterable[Acl] = ()
) -> None:
    """Create or update `users`' SCRAM credentials, then add `acls` (both idempotent): as
    `settings`' user, who must be allowed to (the admin)."""
    from confluent_kafka.admin import (
        AdminClient,
        ScramCredentialInfo,
        ScramMechanism,
        UserScramCredentialUpsertion,
    )

    client = AdminClient(confluent_config(settings))
    mechanism = ScramMechanism[MECHANISM.replace("-", "_")]
    upserts: list[Any] = [
        UserScramCredentialUpsertion(
            user.name, ScramCredentialInfo(mechanism, SCRAM_ITERATIONS), user.password.encode()
        )
        for user in users
    ]
    if upserts:
        _wait_all(
            client.alter_user_scram_credentials(upserts, request_timeout=ADMIN_TIMEOUT_S),
            "storing Kafka users' credentials",
            settings,
        )
    bindings = [_binding(acl) for acl in acls]
    if bindings:
        _wait_all(
            client.create_acls(bindings, request_timeout=ADMIN_TIMEOUT_S),
            "adding Kafka ACLs",
            settings,
        )


async def grant(
    settings: KafkaSettings, users: Iterable[KafkaUser] = (), acls: Iterable[Acl] = ()
) -> None:
    """`grant_sync` off the event loop (librdkafka's calls block)."""
    await asyncio.to_thread(grant_sync, settings, list(users), list(acls))


def granted_sync(settings: KafkaSettings, user: str | None = None) -> list[Acl]:
    """The ACLs the brokers hold (of `user` only, if given), read back."""
    from confluent_kafka.admin import (
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        AdminClient,
        ResourcePatternType,
        ResourceType,
    )

    client = AdminClient(confluent_config(settings))
    # None matches any name, principal or host (librdkafka's filter; its stubs say str).
    anything: Any = None
    wanted = AclBindingFilter(
        ResourceType.ANY,
        anything,
        ResourcePatternType.ANY,
        f"User:{user}" if user else anything,
        anything,
        AclOperation.ANY,
        AclPermissionType.ANY,
    )
    future = client.describe_acls(wanted, request_timeout=ADMIN_TIMEOUT_S)
    try:
        bindings = future.result(timeout=ADMIN_TIMEOUT_S)
    except Exception as e:
        raise BusError(f"listing Kafka ACLs on {settings.bootstrap_servers} failed: {e}") from e
    return sorted(
        Acl(
            binding.principal.removeprefix("User:"),
            binding.operation.name.capitalize(),
            "topic" if binding.restype == ResourceType.TOPIC else "group",
            binding.name,
            "prefixed"
            if binding.resource_pattern_type == ResourcePatternType.PREFIXED
            else "literal",
        )
        for binding in bindings
    )
