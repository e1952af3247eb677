"""Settings of the checkpoint-server, from CHECKPOINT_SERVER_* environment variables (plus the node-wide ones)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rlnode.settings import ServiceSettings

SERVICE_NAME = "checkpoint-server"


class CheckpointServerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="CHECKPOINT_SERVER_", extra="ignore")

    port: int = Field(8750, ge=0, le=65535)
