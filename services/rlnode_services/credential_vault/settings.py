"""Settings of the credential-vault, from VAULT_* environment variables (plus the node-wide ones)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from rlnode.service.settings import ServiceSettings

SERVICE_NAME = "credential-vault"
DAY_S = 86_400


class VaultSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="VAULT_", extra="ignore")

    port: int = Field(8710, ge=0, le=65535)

    # The key every org private key is wrapped under: 32 random bytes, base64. Exactly one of
    # these two; `rlnode vault master-key` prints a new one.
    master_key: SecretStr | None = None
    master_key_file: Path | None = None

    # Bootstrap admin: creates orgs and service tokens. Without it those routes answer 401.
    admin_token: SecretStr | None = None

    max_secret_bytes: int = Field(8192, ge=1, le=1024 * 1024)
    org_token_ttl_s: int = Field(90 * DAY_S, ge=60)
    service_token_ttl_s: int = Field(30 * DAY_S, ge=60)
    max_token_ttl_s: int = Field(365 * DAY_S, ge=60)

    @field_validator("admin_token")
    @classmethod
    def _admin_token_strong(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError("VAULT_ADMIN_TOKEN must be at least 32 characters of random text")
        return value
