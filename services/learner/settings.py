"""Settings of the learner, from LEARNER_* environment variables (plus the node-wide ones)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rlnode.settings import ServiceSettings

SERVICE_NAME = "learner"


class LearnerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="LEARNER_", extra="ignore")

    port: int = Field(8740, ge=0, le=65535)
