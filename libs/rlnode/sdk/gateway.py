"""Client of the taskapp-gateway: register, list, verify and remove Task Apps; run rollouts
(services)."""

from __future__ import annotations

import os
from typing import Any

import httpx

from rlnode.auth import read_unverified

DEFAULT_GATEWAY_URL = "http://127.0.0.1:8720"


class GatewayError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"gateway: {message}" + (f" (HTTP {status})" if status else ""))
        self.status = status
        self.message = message


class GatewayClient:
    def __init__(
        self, url: str | None = None, token: str | None = None, *, timeout_s: float = 330.0
    ) -> None:
        self.url = (url or os.environ.get("RLNODE_GATEWAY_URL") or DEFAULT_GATEWAY_URL).rstrip("/")
        self.token = token
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _org(self, org_id: str | None) -> str:
        if org_id:
            return org_id
        org = read_unverified(self.token or "").get("org") if self.token else None
        if not org:
            raise GatewayError(0, "no org: pass one, or use an org token (RLNODE_TOKEN)")
        return org

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            response = self._http.request(method, path, headers=headers, **kwargs)
        except httpx.TransportError as e:
            raise GatewayError(
                0,
                f"cannot reach the gateway at {self.url}: {e}; is it running (RLNODE_GATEWAY_URL)?",
            ) from None
        if response.status_code >= 400:
            try:
                message = response.json().get("detail", response.text)
            except ValueError:
                message = response.text or response.reason_phrase
            raise GatewayError(response.status_code, str(message))
        if response.status_code == 204:
            return None
        return (
            response.json()
            if response.headers.get("content-type", "").startswith("application/json")
            else response.text
        )

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
    ) -> dict:
        body = {
            "name": name,
            "url": url,
            "command": command,
            "cwd": cwd,
            "env": env or {},
            "secret": secret,
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
