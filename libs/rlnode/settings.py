"""Settings shared by every service, read from the environment (pydantic-settings).

Names without a prefix are the node-wide ones from DESIGN.md (KAFKA_BOOTSTRAP_SERVERS,
DATABASE_URL, RLNODE_DATA_DIR); each service adds its own prefixed settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Trajectories of long multi-turn episodes (token ids + logprobs) are large: records up to
# this size fit (after compression) on the producer, the topics and the consumers.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def default_data_dir() -> Path:
    return Path.home() / ".rlnode"


class NodeSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore")

    data_dir: Path = Field(default_factory=default_data_dir, validation_alias="RLNODE_DATA_DIR")

    @property
    def checkpoint_dir(self) -> Path:
        return self.data_dir / "checkpoints"


class KafkaSettings(BaseSettings):
    """How to reach the broker. With no KAFKA_BOOTSTRAP_SERVERS the local tools start
    an embedded broker (see rlnode.localbroker) and set it for the services they start."""

    model_config = SettingsConfigDict(env_prefix="KAFKA_", extra="ignore")

    bootstrap_servers: str = "127.0.0.1:9092"
    client_id_prefix: str = "rlnode"
    partitions: int = Field(3, ge=1, le=1024, description="Partitions per topic on creation.")
    replication_factor: int = Field(1, ge=1)
    compression: Literal["zstd", "gzip", "none"] = "zstd"
    max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, ge=1024 * 1024)
    linger_ms: int = Field(5, ge=0, le=1000)
    request_timeout_ms: int = Field(40_000, ge=1000)
    # A consumer group's first join waits for stragglers (Tansu: half the session timeout,
    # Kafka: group.initial.rebalance.delay.ms); tests shorten it, production keeps it.
    session_timeout_ms: int = Field(10_000, ge=1000)
    # How long a fetch may wait for data. Kafka answers as soon as a record arrives; Tansu
    # holds the fetch (measured: ~125 ms per hop at aiokafka's 500 ms, ~25 at 100, ~10 at
    # 20), and a job step crosses the broker three times. Lower costs idle polling: a whole
    # idle node used 5% of a core at 500 ms, 22% at 50, 45% at 20, and a max_async=1 job on
    # 2 cores was no faster at 50 (bench/overhead.py): aiokafka's 500 stays the default.
    fetch_max_wait_ms: int = Field(500, ge=1, le=10_000)
    heartbeat_interval_ms: int = Field(3_000, ge=100)

    @field_validator("bootstrap_servers")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("KAFKA_BOOTSTRAP_SERVERS is empty; give host:port[,host:port]")
        return value.strip()

    @model_validator(mode="after")
    def _heartbeat_below_session(self) -> KafkaSettings:
        if self.heartbeat_interval_ms * 3 > self.session_timeout_ms:
            raise ValueError(
                f"KAFKA_HEARTBEAT_INTERVAL_MS ({self.heartbeat_interval_ms}) must be at most a "
                f"third of KAFKA_SESSION_TIMEOUT_MS ({self.session_timeout_ms})"
            )
        return self


class DatabaseSettings(BaseSettings):
    """DATABASE_URL if set (PostgreSQL in production), else SQLite under the data directory."""

    model_config = SettingsConfigDict(extra="ignore")

    database_url: str | None = Field(None, validation_alias="DATABASE_URL")
    echo_sql: bool = Field(False, validation_alias="RLNODE_ECHO_SQL")

    def url_for(self, service: str, node: NodeSettings | None = None) -> str:
        if self.database_url:
            return self.database_url
        data_dir = (node or NodeSettings()).data_dir
        return f"sqlite:///{data_dir / 'db' / f'{service}.sqlite3'}"


class ServiceSettings(BaseSettings):
    """Base of each service's settings: where it listens and how it logs. Subclasses set
    `env_prefix` (e.g. VAULT_) and add their own fields."""

    model_config = SettingsConfigDict(extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(ge=0, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Off by default: a line per request is three per rollout on the hot path (a few percent
    # of the gateway's CPU), and the generator's request paths are per-rollout capability
    # URLs that do not belong in a log file.
    access_log: bool = False
    shutdown_grace_s: float = Field(15.0, gt=0)

    node: NodeSettings = Field(default_factory=NodeSettings)
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
