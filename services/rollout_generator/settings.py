"""Settings of the rollout-generator, from GENERATOR_* environment variables (plus the node-wide ones)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rlnode.settings import ServiceSettings

SERVICE_NAME = "rollout-generator"


class GeneratorSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="GENERATOR_", extra="ignore")

    port: int = Field(8730, ge=0, le=65535)
