"""A real credential-vault process for tests, on SQLite or PostgreSQL."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from rlnode.bus.localbroker import free_port
from rlnode.node.processes import ServiceProcess
from rlnode.sdk.vault import VaultClient
from rlnode.service.registry import SERVICES_BY_NAME
from rlnode.testing import unique_id
from rlnode_services.credential_vault.crypto import new_master_key


class RecordingTransport(httpx.HTTPTransport):
    """Keeps every response body, for scans of what left the vault."""

    def __init__(self) -> None:
        super().__init__()
        self.responses: list[tuple[str, str, int, bytes]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        body = response.read()
        self.responses.append((request.method, request.url.path, response.status_code, body))
        return response


@dataclass
class RunningVault:
    database_url: str
    data_dir: Path
    master_key: str = field(default_factory=new_master_key)
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    process: ServiceProcess | None = None
    port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "vault.log"

    def env(self, **overrides: str | None) -> dict[str, str]:
        env = {
            "VAULT_MASTER_KEY": self.master_key,
            "VAULT_ADMIN_TOKEN": self.admin_token,
            "DATABASE_URL": self.database_url,
            "RLNODE_DATA_DIR": str(self.data_dir),
        }
        env.update({k: v for k, v in overrides.items() if v is not None})
        return env

    def start(self) -> RunningVault:
        self.process = ServiceProcess(
            SERVICES_BY_NAME["credential-vault"], self.port, self.log_path, env=self.env()
        ).start()
        self.process.wait_healthy()
        return self

    def stop(self) -> int:
        return self.process.stop() if self.process else 0

    def client(
        self, token: str | None, transport: httpx.BaseTransport | None = None
    ) -> VaultClient:
        return VaultClient(self.url, token, transport=transport)

    def admin(self) -> VaultClient:
        return self.client(self.admin_token)

    def new_org(self) -> tuple[str, str]:
        """A fresh org; returns (org_id, its admin token)."""
        org_id = unique_id("org")
        with self.admin() as admin:
            return org_id, admin.create_org(org_id)["token"]["token"]

    def service_token(
        self, scopes: list[str], org_id: str | None = None, service: str = "taskapp-gateway"
    ) -> str:
        with self.admin() as admin:
            return admin.create_service_token(service, scopes, org_id)["token"]
