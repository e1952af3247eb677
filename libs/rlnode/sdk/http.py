"""What every rlnode API client shares: base URL from the environment, bearer token,
errors that carry the service's own message."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import httpx

from rlnode.sdk.local_node import discovered_url
from rlnode.service.auth import AuthError, read_unverified
from rlnode.service.pooled_http import IDLE_CONNECTION_S
from rlnode.service.registry import ServiceSpec


class ApiError(RuntimeError):
    """The service said no (`status` and its message), or could not be reached (status 0)."""

    service: ClassVar[str] = "rlnode"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{self.service}: {message}" + (f" (HTTP {status})" if status else ""))
        self.status = status
        self.message = message


def service_url(spec: ServiceSpec, url: str | None = None) -> str:
    """`url`, else the service's URL variable, else where the node `rlnode up` runs here
    says it answers, else its default on this machine."""
    env = spec.client_url_env or f"{spec.env_prefix}URL"
    return (url or os.environ.get(env) or discovered_url(spec) or spec.default_url).rstrip("/")


class ApiClient:
    error: ClassVar[type[ApiError]] = ApiError
    spec: ClassVar[ServiceSpec]  # the service it talks to: its URL variable and default URL

    @property
    def url_env(self) -> str:
        return self.spec.client_url_env or f"{self.spec.env_prefix}URL"

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = service_url(self.spec, url)
        self.token = token
        self._http = httpx.Client(
            base_url=self.url,
            timeout=timeout_s,
            transport=transport,
            limits=httpx.Limits(keepalive_expiry=IDLE_CONNECTION_S),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def org_id(self) -> str:
        """The org the client's token belongs to (read from the token itself)."""
        if not self.token:
            raise self.error(0, "no token: set RLNODE_TOKEN or pass one")
        try:
            org = read_unverified(self.token).get("org")
        except AuthError as e:
            raise self.error(0, e.message) from None
        if not org:
            raise self.error(0, "this token names no org; pass the org explicitly")
        return org

    def _org(self, org_id: str | None) -> str:
        return org_id or self.org_id

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._send(method, path, **kwargs)
        if response.status_code == 204:
            return None
        if response.headers.get("content-type", "").startswith("application/json"):
            return response.json()
        return response.text

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The response, or this client's error with the service's own message."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            response = self._http.request(method, path, headers=headers, **kwargs)
        except httpx.TransportError as e:
            raise self.error(
                0,
                f"cannot reach the {self.error.service} at {self.url}: {e}; is it running ({self.url_env})?",
            ) from None
        if response.status_code >= 400:
            try:
                message = response.json().get("detail", response.text)
            except (ValueError, AttributeError):
                message = response.text or response.reason_phrase
            raise self.error(response.status_code, str(message))
        return response
