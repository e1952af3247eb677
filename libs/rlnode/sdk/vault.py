"""Client of the credential-vault. Secrets are sealed here, on the caller's machine, with the
org's public key; only ciphertext is sent. Unsealed secrets are opened here too, with the
caller's own private key."""

from __future__ import annotations

from typing import Any

from nacl.public import PrivateKey

from rlnode.sdk.http import ApiClient, ApiError
from rlnode.service.registry import VAULT
from rlnode.service.sealing import (
    SEALED_BOX_ALG,
    b64decode_strict,
    open_sealed,
    public_key_b64,
    public_key_from_b64,
    seal,
)


class VaultError(ApiError):
    service = "vault"


class VaultClient(ApiClient):
    error = VaultError
    spec = VAULT

    # -- orgs, keys, tokens ----------------------------------------------------------

    def create_org(self, org_id: str, name: str | None = None) -> dict:
        """Needs the admin token. Returns the org, its public key and its first admin token."""
        return self._request("POST", "/v1/orgs", json={"org_id": org_id, "name": name})

    def public_key(self, org_id: str | None = None) -> dict:
        org_id = self._org(org_id)
        key = self._request("GET", f"/v1/orgs/{org_id}/public-key")
        if key.get("alg") != SEALED_BOX_ALG:
            raise VaultError(
                0, f"the vault offers {key.get('alg')!r}, this client seals with {SEALED_BOX_ALG}"
            )
        return key

    def rotate_key(self, org_id: str | None = None) -> dict:
        return self._request("POST", f"/v1/orgs/{self._org(org_id)}/keys/rotate")

    def create_token(
        self,
        name: str,
        scopes: list[str] | None = None,
        ttl_s: int | None = None,
        org_id: str | None = None,
    ) -> dict:
        body = {"name": name, "scopes": scopes, "ttl_s": ttl_s}
        return self._request("POST", f"/v1/orgs/{self._org(org_id)}/tokens", json=body)

    def list_tokens(self, org_id: str | None = None) -> list[dict]:
        return self._request("GET", f"/v1/orgs/{self._org(org_id)}/tokens")

    def revoke_token(self, token_id: str, org_id: str | None = None) -> None:
        self._request("DELETE", f"/v1/orgs/{self._org(org_id)}/tokens/{token_id}")

    def create_job_token(self, job_id: str, org_id: str | None = None) -> str:
        """A job token: what a job request carries on Kafka (single-use, minutes long)."""
        body = {"job_id": job_id}
        return self._request("POST", f"/v1/orgs/{self._org(org_id)}/job-tokens", json=body)["token"]

    def certify_record_key(self, public_key: bytes) -> dict:
        """With a service token holding records:sign: the vault's certificate for this
        process's record-signing key ({certificate, service, expires_at})."""
        import base64

        body = {"public_key": base64.b64encode(public_key).decode()}
        return self._request("POST", "/v1/record-keys", json=body)

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
        org_id = self._org(org_id)
        raw = value.encode() if isinstance(value, str) else value
        if not raw:
            raise VaultError(0, "refusing to store an empty secret")
        key = self.public_key(org_id)
        ciphertext = seal(raw, public_key_from_b64(key["public_key"]))
        body = {"name": name, "key_id": key["key_id"], "ciphertext_b64": ciphertext}
        return self._request("POST", f"/v1/orgs/{org_id}/secrets", json=body)

    def list_secrets(self, org_id: str | None = None) -> list[dict]:
        return self._request("GET", f"/v1/orgs/{self._org(org_id)}/secrets")

    def get_secret_info(self, name: str, org_id: str | None = None) -> dict:
        return self._request("GET", f"/v1/orgs/{self._org(org_id)}/secrets/{name}")

    def delete_secret(self, name: str, org_id: str | None = None) -> None:
        self._request("DELETE", f"/v1/orgs/{self._org(org_id)}/secrets/{name}")

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
        return self._request("GET", f"/v1/orgs/{self._org(org_id)}/audit", params=params)
