"""Settings of the credential-vault, from VAULT_* environment variables (plus the node-wide ones)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rlnode.settings import ServiceSettings

SERVICE_NAME = "credential-vault"


class VaultSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="VAULT_", extra="ignore")

    port: int = Field(8710, ge=0, le=65535)
