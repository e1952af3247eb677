"""Settings shared by every service, read from the environment (pydantic-settings).

Names without a prefix are node-wide (KAFKA_*, DATABASE_URL, RLNODE_DATA_DIR); each service
adds its own, prefixed as the service registry declares (VAULT_, GATEWAY_, ...). Every field
says what it means: the READMEs' settings tables are generated from these descriptions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlnode.bus.settings import KafkaSettings
from rlnode.service.registry import LOOPBACK, VAULT


def default_data_dir() -> Path:
    return Path.home() / ".rlnode"


class NodeSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore")

    data_dir: Path = Field(
        default_factory=default_data_dir,
        validation_alias="RLNODE_DATA_DIR",
        description="Databases, logs, secrets and the checkpoint store (default ~/.rlnode).",
    )
    checkpoint_store: Path | None = Field(
        None,
        validation_alias="RLNODE_CHECKPOINT_DIR",
        description="The checkpoint store every service of the node shares: <org>/<job>/ per "
        "job (default: $RLNODE_DATA_DIR/checkpoints).",
    )
    weights_store: Path = Field(
        Path("/dev/shm/rlnode-weights"),
        validation_alias="RLNODE_WEIGHTS_DIR",
        description="Where weight versions for the generators go when it has room (memory, on "
        "one node), <org>/<job>/ per job; else beside the job's checkpoints.",
    )

    model_store: Path | None = Field(
        None,
        validation_alias="RLNODE_MODEL_DIR",
        description="Models imported on this node (GGUF files dequantized into HF directories, "
        "one per file and dtype); every org's jobs may start from them (default: "
        "$RLNODE_DATA_DIR/models).",
    )

    @property
    def checkpoint_dir(self) -> Path:
        return self.checkpoint_store or self.data_dir / "checkpoints"

    @property
    def model_dir(self) -> Path:
        return self.model_store or self.data_dir / "models"

    @property
    def stores(self) -> tuple[Path, Path]:
        """Where a record's file:// URI may point: inside <store>/<org>/<job>/ of these."""
        return self.checkpoint_dir, self.weights_store


class DatabaseSettings(BaseSettings):
    """DATABASE_URL if set (PostgreSQL in production), else SQLite under the data directory."""

    model_config = SettingsConfigDict(extra="ignore")

    database_url: str | None = Field(
        None,
        validation_alias="DATABASE_URL",
        description="postgresql://... in production; unset: SQLite under $RLNODE_DATA_DIR/db/.",
    )
    echo_sql: bool = Field(
        False, validation_alias="RLNODE_ECHO_SQL", description="Log every SQL statement."
    )

    def url_for(self, service: str, node: NodeSettings | None = None) -> str:
        if self.database_url:
            return self.database_url
        data_dir = (node or NodeSettings()).data_dir
        return f"sqlite:///{data_dir / 'db' / f'{service}.sqlite3'}"


class ServiceSettings(BaseSettings):
    """Base of each service's settings: where it listens and how it logs. Subclasses set
    `env_prefix` and the default port from their registry entry, and add their own fields."""

    model_config = SettingsConfigDict(extra="ignore")

    host: str = Field(LOOPBACK, description="Address to listen on.")
    port: int = Field(ge=0, le=65535, description="HTTP port (default: the service's own).")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="debug, info, warning or error."
    )
    # Off by default: a line per request is three per rollout on the hot path (a few percent
    # of the gateway's CPU), and the generator's request paths are per-rollout capability
    # URLs that do not belong in a log file.
    access_log: bool = Field(False, description="A log line per HTTP request.")
    shutdown_grace_s: float = Field(
        15.0, gt=0, description="On SIGTERM, how long requests in flight may finish."
    )

    node: NodeSettings = Field(default_factory=NodeSettings)
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)


class VaultClientSettings(ServiceSettings):
    """Base of the services other than the vault: where the vault is, and this service's own
    token from it."""

    vault_url: str = Field(
        VAULT.default_url, description="Where tokens are checked and identities come from."
    )
    service_token: SecretStr | None = Field(
        None,
        description="This service's node-wide token from the vault, with the scopes the service "
        "registry gives it (`rlnode token create <service> --service --scope ...`; `rlnode up` "
        "mints it).",
    )
