"""Settings of the taskapp-gateway, from GATEWAY_* environment variables (plus the node-wide ones)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from rlnode.service.registry import GATEWAY
from rlnode.service.settings import VaultClientSettings
from rlnode_services.taskapp_gateway.firewall import parse_allowances

SERVICE = GATEWAY


class GatewaySettings(VaultClientSettings):
    model_config = SettingsConfigDict(env_prefix=SERVICE.env_prefix, extra="ignore")

    port: int = Field(SERVICE.port, ge=0, le=65535, description="HTTP port.")

    # Managed Task Apps
    runs_managed: bool = Field(
        True,
        description="This gateway starts and supervises the managed Task Apps and registers "
        "them (one per node does); the node's other gateways (false) run rollouts on them at "
        "the address it records in the database.",
    )
    start_timeout_s: float = Field(30.0, gt=0, description="From spawn to a healthy /health.")
    health_interval_s: float = Field(
        5.0, gt=0, description="How often a managed Task App is health-checked."
    )
    unhealthy_after: int = Field(
        3, ge=1, description="Failed health checks in a row before a restart."
    )
    restart_backoff_s: float = Field(
        0.5, gt=0, description="First restart delay; doubles per crash."
    )
    restart_backoff_max_s: float = Field(30.0, gt=0, description="Longest restart delay.")
    stable_after_s: float = Field(60.0, gt=0, description="Up this long resets the backoff.")
    stop_grace_s: float = Field(
        10.0, gt=0, description="From SIGTERM to SIGKILL when a Task App is stopped."
    )

    # The sandbox of managed Task Apps (docs/security.md)
    sandbox_user: Literal["auto", "off"] = Field(
        "auto",
        description="auto: each managed Task App runs as a user of its own when the gateway "
        "runs as root (else as the gateway's user, with the rest of the sandbox); off: as the "
        "gateway's user always (only where every registrant is trusted).",
    )
    sandbox_uid_base: int = Field(
        200_000, ge=1000, le=2**31 - 2**21, description="First uid given to Task Apps."
    )
    sandbox_dir: Path = Field(
        Path(tempfile.gettempdir()) / "rlnode-taskapps",
        description="Where each managed Task App gets its private home directory.",
    )
    taskapp_network: Literal["isolated", "open"] = Field(
        "isolated",
        description="isolated: each managed Task App reaches the generators' rollout "
        "endpoints, the gateway's calls and what GATEWAY_TASKAPP_ALLOW_TO names, nothing else "
        "(per-uid nftables rules: needs root and nft; without them managed Task Apps do not "
        "start); open: no network rules (every port of the machine is within a Task App's "
        "reach: the broker, the vault, other orgs' Task Apps). docs/security.md.",
    )
    taskapp_allow_to: list[str] = Field(
        default_factory=list,
        description="What else managed Task Apps may reach, isolated (JSON list of CIDRs, "
        'CIDRs with one port ("127.0.0.1:8080", "[::1]:8080"), or "public": every public '
        'address, and DNS), e.g. ["public"] for an app that calls an outside API, '
        '["127.0.0.1:8080"] for an environment server on this machine.',
    )
    taskapp_firewall_table: str | None = Field(
        None,
        pattern=r"^[A-Za-z][A-Za-z0-9_]{0,30}$",
        description="The nftables table of this node's Task App rules; default: named from "
        "the database the node's gateways share.",
    )
    taskapp_path: str = Field(
        "/usr/local/bin:/usr/bin:/bin", description="PATH of managed Task Apps."
    )
    taskapp_memory_mb: int = Field(
        4096, ge=64, description="Address space of a managed Task App that names none, MiB."
    )
    taskapp_max_memory_mb: int = Field(
        16384, ge=64, description="The most a registration may ask (limits.memory_mb)."
    )
    taskapp_processes: int = Field(
        256, ge=8, description="Processes and threads of a managed Task App that names none."
    )
    taskapp_max_processes: int = Field(
        2048, ge=8, description="The most a registration may ask (limits.processes)."
    )
    taskapp_open_files: int = Field(
        1024, ge=32, description="Open files of a managed Task App that names none."
    )
    taskapp_max_open_files: int = Field(
        16384, ge=32, description="The most a registration may ask (limits.open_files)."
    )

    # Calls to Task Apps
    allow_urls_to: list[Literal["loopback", "link-local", "private"]] = Field(
        default_factory=list,
        description="Kinds of non-public address an external Task App's URL may resolve to "
        '(JSON list, e.g. ["loopback"]; rlnode up allows loopback). Empty: public addresses only.',
    )
    rollout_timeout_s: float = Field(300.0, gt=0, description="Default when a request names none.")
    connect_timeout_s: float = Field(5.0, gt=0, description="To connect to a Task App.")
    connect_retries: int = Field(3, ge=0, description="Retries on connection errors only.")
    key_cache_s: float = Field(300.0, ge=0, description="How long an unsealed key is reused.")
    registry_cache_s: float = Field(
        2.0,
        ge=0,
        description="How long a Task App's registration is reused for rollouts before it is "
        "read from the database again (this gateway's own changes apply at once).",
    )

    @field_validator("taskapp_allow_to")
    @classmethod
    def _allowances(cls, value: list[str]) -> list[str]:
        parse_allowances(value)  # says which entry is not "public", a CIDR or one with a port
        return value
