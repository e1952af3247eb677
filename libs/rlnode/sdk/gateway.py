"""Client of the taskapp-gateway: register, list, verify and remove Task Apps; run rollouts
(services)."""

from __future__ import annotations

from collections.abc import Sequence

from rlnode.sdk.http import ApiClient, ApiError
from rlnode.service.registry import GATEWAY


class GatewayError(ApiError):
    service = "gateway"


class GatewayClient(ApiClient):
    error = GatewayError
    spec = GATEWAY

    def __init__(
        self, url: str | None = None, token: str | None = None, *, timeout_s: float = 330.0
    ) -> None:
        super().__init__(url, token, timeout_s=timeout_s)

    def register(
        self,
        name: str,
        *,
        url: str | None = None,
        command: list[str] | str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        secret: str = "ENVIRONMENT_API_KEY",
        org_id: str | None = None,
        limits: dict[str, int] | None = None,
    ) -> dict:
        """`limits` (managed): memory_mb, processes, open_files, within the node's caps."""
        body = {
            "name": name,
            "url": url,
            "command": command,
            "cwd": cwd,
            "env": env or {},
            "secret": secret,
            "limits": limits,
        }
        return self._request("POST", f"/v1/orgs/{self._org(org_id)}/taskapps", json=body)

    def list(self, org_id: str | None = None) -> list[dict]:
        return self._request("GET", f"/v1/orgs/{self._org(org_id)}/taskapps")

    def get(self, name: str, org_id: str | None = None) -> dict:
        return self._request("GET", f"/v1/orgs/{self._org(org_id)}/taskapps/{name}")

    def verify(self, name: str, org_id: str | None = None) -> dict:
        return self._request("POST", f"/v1/orgs/{self._org(org_id)}/taskapps/{name}/verify")

    def logs(self, name: str, org_id: str | None = None, max_bytes: int = 20_000) -> str:
        return self._request(
            "GET",
            f"/v1/orgs/{self._org(org_id)}/taskapps/{name}/logs",
            params={"max_bytes": max_bytes},
        )

    def remove(self, name: str, org_id: str | None = None) -> None:
        self._request("DELETE", f"/v1/orgs/{self._org(org_id)}/taskapps/{name}")

    def rollout(
        self,
        org_id: str,
        task_app: str,
        request: dict,
        *,
        job_id: str | None = None,
        timeout_s: float | None = None,
    ) -> dict:
        """For services (rollouts:run): one rollout; a dict with status ok|failed."""
        body = {
            "org_id": org_id,
            "task_app": task_app,
            "job_id": job_id,
            "timeout_s": timeout_s,
            "request": request,
        }
        return self._request("POST", "/v1/rollouts", json=body)

    def rollouts(
        self,
        org_id: str,
        task_app: str,
        requests: Sequence[dict],
        *,
        job_id: str | None = None,
        timeout_s: float | None = None,
        with_response: bool = False,
    ) -> Sequence[dict]:
        """For services (rollouts:run): several rollouts of one job at once, each failing
        alone; their outcomes in the order asked."""
        body = {
            "org_id": org_id,
            "task_app": task_app,
            "job_id": job_id,
            "timeout_s": timeout_s,
            "requests": list(requests),
            "with_response": with_response,
        }
        return self._request("POST", "/v1/rollout-groups", json=body)["outcomes"]
