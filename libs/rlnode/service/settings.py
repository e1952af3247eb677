"""Settings shared by every service, read from the environment (pydantic-settings).

Names without a prefix are the node-wide ones from DESIGN.md (KAFKA_BOOTSTRAP_SERVERS,
DATABASE_URL, RLNODE_DATA_DIR); each service adds its own prefixed settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlnode.bus.settings import KafkaSettings


def default_data_dir() -> Path:
    return Path.home() / ".rlnode"


class NodeSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore")

    data_dir: Path = Field(default_factory=default_data_dir, validation_alias="RLNODE_DATA_DIR")

    @property
    def checkpoint_dir(self) -> Path:
        return self.data_dir / "checkpoints"


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
