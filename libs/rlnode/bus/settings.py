"""How to reach the broker and how the bus uses it, from KAFKA_* environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Trajectories of long multi-turn episodes (token ids + logprobs) are large: records up to
# this size fit (after compression) on the producer, the topics and the consumers.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class KafkaSettings(BaseSettings):
    """How to reach the broker. With no KAFKA_BOOTSTRAP_SERVERS the local tools start
    an embedded broker (see rlnode.bus.localbroker) and set it for the services they start."""

    model_config = SettingsConfigDict(env_prefix="KAFKA_", extra="ignore")

    bootstrap_servers: str = Field(
        "127.0.0.1:9092",
        description="The broker (host:port[,host:port]). `rlnode up`, `demo` and `doctor` start "
        "an embedded one when it is not set.",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_SSL"] = Field(
        "PLAINTEXT",
        description="SASL_SSL: TLS and a Kafka user and password (a node's brokers: "
        "`rlnode up` gives each service its user; `rlnode kafka-credentials` an org's); SSL: "
        "TLS with a client certificate; PLAINTEXT: neither (a broker of your own only).",
    )
    ssl_cafile: Path | None = Field(
        None, description="The CA that signed the broker's certificate (PEM); SSL, SASL_SSL."
    )
    ssl_certfile: Path | None = Field(None, description="This client's certificate (PEM).")
    ssl_keyfile: Path | None = Field(None, description="This client's private key (PEM).")
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        "SCRAM-SHA-512", description="How a SASL_SSL client proves its user (over TLS)."
    )
    sasl_username: str | None = Field(None, description="The Kafka user, with SASL_SSL.")
    sasl_password: SecretStr | None = Field(None, description="Its password, with SASL_SSL.")
    client_id_prefix: str = Field("rlnode", description="Prefix of every client id.")
    partitions: int = Field(3, ge=1, le=1024, description="Partitions per topic on creation.")
    replication_factor: int = Field(1, ge=1, description="Replicas per topic on creation.")
    compression: Literal["zstd", "gzip", "none"] = Field(
        "zstd", description="Producer compression: zstd, gzip or none."
    )
    max_message_bytes: int = Field(
        DEFAULT_MAX_MESSAGE_BYTES,
        ge=1024 * 1024,
        description="Largest record after compression (the topics' max.message.bytes); "
        "before compression 4x that.",
    )
    linger_ms: int = Field(5, ge=0, le=1000, description="How long the producer batches.")
    request_timeout_ms: int = Field(
        40_000, ge=1000, description="How long a request to the broker may take."
    )
    # The idempotent producer retries a record until the broker has it (no duplicates from
    # its retries); a publish gives up waiting after this, as Kafka's delivery.timeout.ms.
    delivery_timeout_ms: int = Field(
        120_000,
        ge=1000,
        description="How long a publish waits for the brokers' acknowledgement before it "
        "fails (the record may still arrive: consumers dedupe by record id).",
    )
    # How long a group waits for a member that stopped answering before it hands the
    # member's partitions to the others.
    session_timeout_ms: int = Field(
        10_000, ge=1000, description="A group member silent this long is dropped."
    )
    # How long a fetch may wait for data: Kafka answers as soon as a record arrives, so this
    # is what an idle consumer costs (one fetch per partition leader per wait), not latency.
    fetch_max_wait_ms: int = Field(
        500,
        ge=1,
        le=10_000,
        description="Longest a fetch waits for data (Kafka answers as soon as a record arrives).",
    )
    # The rollout path's consumers (work to generators, weight versions to generators,
    # trajectories to the learner) may wait less than the rest. On Tansu, whose fetch did not
    # answer as soon as a record arrived, 50 ms here bounded the services (bench/overhead.py:
    # 252 samples/s at 500 ms, 431 at 50). Apache Kafka answers at once, so a short wait buys
    # nothing and costs every idle consumer a fetch over TLS each time: on B8 (2 cores,
    # secured broker, 2 x 2 jobs each) 500 ms against 50 made 406 against 410 rollouts/s with
    # the broker's CPU per rollout 0.88 against 1.02 ms, and an idle node's processes took
    # 19% of a core against 24%.
    rollout_fetch_max_wait_ms: int = Field(
        500,
        ge=1,
        le=10_000,
        description="fetch_max_wait_ms of the rollout path's consumers (work, weight "
        "versions, trajectories).",
    )
    heartbeat_interval_ms: int = Field(
        3_000, ge=100, description="Group heartbeats; at most a third of the session timeout."
    )

    @classmethod
    def from_exports(cls, env: dict[str, str]) -> KafkaSettings:
        """Settings from KAFKA_* variables given as a dict (what `connection_env` and
        `rlnode kafka-credentials --json` give), not from this process's environment."""
        return cls.model_validate(
            {k.removeprefix("KAFKA_").lower(): v for k, v in env.items() if k.startswith("KAFKA_")}
        )

    def connection_env(self) -> dict[str, str]:
        """The KAFKA_* variables that make a process's clients connect as these do."""
        env = {
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap_servers,
            "KAFKA_SECURITY_PROTOCOL": self.security_protocol,
            "KAFKA_SASL_MECHANISM": self.sasl_mechanism,
        }
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "sasl_username"):
            value = getattr(self, name)
            if value is not None:
                env[f"KAFKA_{name.upper()}"] = str(value)
        if self.sasl_password is not None:
            env["KAFKA_SASL_PASSWORD"] = self.sasl_password.get_secret_value()
        return env

    @field_validator("bootstrap_servers")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("KAFKA_BOOTSTRAP_SERVERS is empty; give host:port[,host:port]")
        return value.strip()

    @model_validator(mode="after")
    def _ssl_files(self) -> KafkaSettings:
        if self.security_protocol == "SSL":
            missing = [
                f"KAFKA_{name.upper()}"
                for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile")
                if getattr(self, name) is None
            ]
            if missing:
                raise ValueError(
                    f"KAFKA_SECURITY_PROTOCOL=SSL needs {', '.join(missing)}: the node's CA "
                    "and a client certificate and key (rlnode kafka-cert NAME --out DIR "
                    "writes them on the control host)"
                )
        if self.security_protocol == "SASL_SSL" and not (self.sasl_username and self.sasl_password):
            raise ValueError(
                "KAFKA_SECURITY_PROTOCOL=SASL_SSL needs KAFKA_SASL_USERNAME and "
                "KAFKA_SASL_PASSWORD (the Kafka user the operator made for this client)"
            )
        return self

    @model_validator(mode="after")
    def _heartbeat_below_session(self) -> KafkaSettings:
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ValueError(
                f"KAFKA_HEARTBEAT_INTERVAL_MS ({self.heartbeat_interval_ms}) must be at most a "
                f"third of KAFKA_SESSION_TIMEOUT_MS ({self.session_timeout_ms})"
            )
        return self
