"""Settings of the taskapp-gateway, from GATEWAY_* environment variables (plus the node-wide ones)."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from rlnode.service.settings import ServiceSettings

SERVICE_NAME = "taskapp-gateway"


class GatewaySettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore")

    port: int = Field(8720, ge=0, le=65535)

    vault_url: str = "http://127.0.0.1:8710"
    # A service token with secrets:unseal (node-wide): how the gateway gets each org's key.
    service_token: SecretStr | None = None

    # Managed Task Apps
    start_timeout_s: float = Field(30.0, gt=0, description="From spawn to a healthy /health.")
    health_interval_s: float = Field(5.0, gt=0)
    unhealthy_after: int = Field(
        3, ge=1, description="Failed health checks in a row before a restart."
    )
    restart_backoff_s: float = Field(
        0.5, gt=0, description="First restart delay; doubles per crash."
    )
    restart_backoff_max_s: float = Field(30.0, gt=0)
    stable_after_s: float = Field(60.0, gt=0, description="Up this long resets the backoff.")
    stop_grace_s: float = Field(10.0, gt=0)

    # Calls to Task Apps
    rollout_timeout_s: float = Field(300.0, gt=0, description="Default when a request names none.")
    connect_timeout_s: float = Field(5.0, gt=0)
    connect_retries: int = Field(3, ge=0, description="Retries on connection errors only.")
    key_cache_s: float = Field(300.0, ge=0, description="How long an unsealed key is reused.")
    registry_cache_s: float = Field(
        2.0,
        ge=0,
        description="How long a Task App's registration is reused for rollouts before it is "
        "read from the database again (this gateway's own changes apply at once).",
    )
