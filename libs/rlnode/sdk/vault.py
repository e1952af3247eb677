"""Client of the credential-vault. Secrets are sealed here, on the caller's machine, with the
org's public key; only ciphertext is sent. Unsealed secrets are opened here too, with the
caller's own private key."""

from __future__ import annotations

import os
from typing import Any

import httpx
from nacl.public import PrivateKey

from rlnode.auth import read_unverified
from rlnode.sealing import (
    SEALED_BOX_ALG,
    b64decode_strict,
    open_sealed,
    public_key_b64,
    public_key_from_b64,
    seal,
)

DEFAULT_VAULT_URL = "http://127.0.0.1:8710"


class VaultError(RuntimeError):
    """The vault said no (`status` and its message), or could not be reached (status 0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"vault: {message}" + (f" (HTTP {status})" if status else ""))
        self.status = status
        self.message = message


class VaultClient:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = (url or os.environ.get("RLNODE_VAULT_URL") or DEFAULT_VAULT_URL).rstrip("/")
        self.token = token
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VaultClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def org_id(self) -> str:
        """The org the client's token belongs to (read from the token itself)."""
        if not self.token:
            raise VaultError(0, "no token: set RLNODE_TOKEN or pass one")
        org = read_unverified(self.token).get("org")
        if not org:
            raise VaultError(0, "this token names no org; pass the org explicitly")
        return org

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            response = self._http.request(method, path, headers=headers, **kwargs)
        except httpx.TransportError as e:
            raise VaultError(
                0, f"cannot reach the vault at {self.url}: {e}; is it running (RLNODE_VAULT_URL)?"
            ) from None
        if response.status_code >= 400:
            try:
                message = response.json().get("detail", response.text)
            except ValueError:
                message = response.text or response.reason_phrase
            raise VaultError(response.status_code, str(message))
        return None if response.status_code == 204 else response.json()

    # -- orgs, keys, tokens ----------------------------------------------------------

    def create_org(self, org_id: str, name: str | None = None) -> dict:
        """Needs the admin token. Returns the org, its public key and its first admin token."""
        return self._request("POST", "/v1/orgs", json={"org_id": org_id, "name": name})

    def public_key(self, org_id: str | None = None) -> dict:
        org_id = org_id or self.org_id
        key = self._request("GET", f"/v1/orgs/{org_id}/public-key")
        if key.get("alg") != SEALED_BOX_ALG:
            raise VaultError(
                0, f"the vault offers {key.get('alg')!r}, this client seals with {SEALED_BOX_ALG}"
            )
        return key

    def rotate_key(self, org_id: str | None = None) -> dict:
        return self._request("POST", f"/v1/orgs/{org_id or self.org_id}/keys/rotate")

    def create_token(
        self,
        name: str,
        scopes: list[str] | None = None,
        ttl_s: int | None = None,
        org_id: str | None = None,
    ) -> dict:
        body = {"name": name, "scopes": scopes, "ttl_s": ttl_s}
        return self._request("POST", f"/v1/orgs/{org_id or self.org_id}/tokens", json=body)

    def list_tokens(self, org_id: str | None = None) -> list[dict]:
        return self._request("GET", f"/v1/orgs/{org_id or self.org_id}/tokens")

    def revoke_token(self, token_id: str, org_id: str | None = None) -> None:
        self._request("DELETE", f"/v1/orgs/{org_id or self.org_id}/tokens/{token_id}")

    def create_service_token(
        self, service: str, scopes: list[str], org_id: str | None = None, ttl_s: int | None = None
    ) -> dict:
        """Needs the admin token."""
        body = {"service": service, "scopes": scopes, "org_id": org_id, "ttl_s": ttl_s}
        return self._request("POST", "/v1/service-tokens", json=body)

    def verify_key(self) -> dict:
        return self._request("GET", "/v1/verify-key")

    # -- secrets ---------------------------------------------------------------------

    def set_secret(self, name: str, value: bytes | str, org_id: str | None = None) -> dict:
        """Seal `value` locally to the org's current public key and upload the ciphertext."""
        org_id = org_id or self.org_id
        raw = value.encode() if isinstance(value, str) else value
        if not raw:
            raise VaultError(0, "refusing to store an empty secret")
        key = self.public_key(org_id)
        ciphertext = seal(raw, public_key_from_b64(key["public_key"]))
        body = {"name": name, "key_id": key["key_id"], "ciphertext_b64": ciphertext}
        return self._request("POST", f"/v1/orgs/{org_id}/secrets", json=body)

    def list_secrets(self, org_id: str | None = None) -> list[dict]:
        return self._request("GET", f"/v1/orgs/{org_id or self.org_id}/secrets")

    def get_secret_info(self, name: str, org_id: str | None = None) -> dict:
        return self._request("GET", f"/v1/orgs/{org_id or self.org_id}/secrets/{name}")

    def delete_secret(self, name: str, org_id: str | None = None) -> None:
        self._request("DELETE", f"/v1/orgs/{org_id or self.org_id}/secrets/{name}")

    def unseal_for(
        self, org_id: str, name: str, private_key: PrivateKey, job_id: str | None = None
    ) -> bytes:
        """For services (a token with secrets:unseal): the secret, re-sealed by the vault to
        `private_key`'s public half and opened here."""
        body = {"recipient_public_key": public_key_b64(private_key.public_key), "job_id": job_id}
        answer = self._request("POST", f"/v1/orgs/{org_id}/secrets/{name}/unseal-for", json=body)
        return open_sealed(b64decode_strict(answer["sealed_b64"], "sealed_b64"), private_key)

    def audit(
        self, org_id: str | None = None, limit: int = 100, action: str | None = None
    ) -> list[dict]:
        params: dict[str, Any] = {"limit": limit}
        if action:
            params["action"] = action
        return self._request("GET", f"/v1/orgs/{org_id or self.org_id}/audit", params=params)
