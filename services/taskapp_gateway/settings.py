"""Settings of the taskapp-gateway, from GATEWAY_* environment variables (plus the node-wide ones)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rlnode.settings import ServiceSettings

SERVICE_NAME = "taskapp-gateway"


class GatewaySettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore")

    port: int = Field(8720, ge=0, le=65535)
