"""Settings of the checkpoint-server, from CHECKPOINT_SERVER_* environment variables (plus the
node-wide ones)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rlnode.service.settings import ServiceSettings

SERVICE_NAME = "checkpoint-server"


class CheckpointServerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="CHECKPOINT_SERVER_", extra="ignore")

    port: int = Field(8750, ge=0, le=65535)
    vault_url: str = "http://127.0.0.1:8710"
    group_id: str = "checkpoint-server"
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    cache_bytes: int = Field(
        4 * 1024**3,
        ge=1,
        description="Memory for loaded checkpoints; the least recently used are unloaded.",
    )
    max_tokens: int = Field(4096, ge=1, description="Upper bound on max_tokens per request.")
    default_max_tokens: int = Field(256, ge=1)
    max_batch_size: int = Field(32, ge=1)
