"""Settings of the credential-vault, from VAULT_* environment variables (plus the node-wide ones)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from rlnode.service.registry import VAULT
from rlnode.service.settings import ServiceSettings

SERVICE = VAULT
DAY_S = 86_400


class VaultSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix=SERVICE.env_prefix, extra="ignore")

    port: int = Field(SERVICE.port, ge=0, le=65535, description="HTTP port.")

    master_key: SecretStr | None = Field(
        None,
        description="The key every org private key is wrapped under: 32 random bytes, base64 "
        "(`rlnode vault master-key` prints one). Exactly one of this and the file.",
    )
    master_key_file: Path | None = Field(
        None, description="A file holding the master key (mode 600 or stricter)."
    )
    admin_token: SecretStr | None = Field(
        None,
        description="Bootstrap admin (at least 32 characters): creates orgs and service "
        "tokens. Unset: those routes answer 401.",
    )
    max_secret_bytes: int = Field(
        8192, ge=1, le=1024 * 1024, description="Larger secrets are refused (413)."
    )
    org_token_ttl_s: int = Field(90 * DAY_S, ge=60, description="Default life of org tokens.")
    service_token_ttl_s: int = Field(
        30 * DAY_S, ge=60, description="Default life of service tokens."
    )
    max_token_ttl_s: int = Field(365 * DAY_S, ge=60, description="Longest life a token may ask.")
    job_token_ttl_s: int = Field(
        600,
        ge=10,
        le=3600,
        description="Life of a job token (what a job request carries on Kafka instead of the "
        "org token): long enough to reach the learner, short enough that one read off the "
        "topic is worthless.",
    )

    @field_validator("admin_token")
    @classmethod
    def _admin_token_strong(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError("VAULT_ADMIN_TOKEN must be at least 32 characters of random text")
        return value
