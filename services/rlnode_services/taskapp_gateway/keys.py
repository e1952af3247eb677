"""Getting an org's Task App key at run time: the vault re-seals it to this process's own
X25519 key pair (made at start-up, never written anywhere) and it is opened here, in memory."""

from __future__ import annotations

import asyncio
import time

from nacl.public import PrivateKey

from rlnode.sdk.vault import VaultClient, VaultError


class KeyUnavailable(Exception):
    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class KeyProvider:
    def __init__(self, vault_url: str, service_token: str | None, cache_s: float) -> None:
        self._private_key = PrivateKey.generate()
        self._vault = VaultClient(vault_url, service_token) if service_token else None
        self._cache_s = cache_s
        self._cache: dict[tuple[str, str], tuple[str, float]] = {}

    @property
    def configured(self) -> bool:
        return self._vault is not None

    async def get(
        self, org_id: str, secret: str, *, job_id: str | None = None, fresh: bool = False
    ) -> str:
        if self._vault is None:
            raise KeyUnavailable(
                "the gateway has no service token: set GATEWAY_SERVICE_TOKEN to a token made with "
                "`rlnode token create taskapp-gateway --service --scope secrets:unseal`"
            )
        cached = self._cache.get((org_id, secret))
        if cached and not fresh and time.monotonic() - cached[1] < self._cache_s:
            return cached[0]
        try:
            raw = await asyncio.to_thread(
                self._vault.unseal_for, org_id, secret, self._private_key, job_id
            )
        except VaultError as e:
            status = 404 if e.status == 404 else 503
            raise KeyUnavailable(
                f"could not get secret {secret!r} of org {org_id!r} from the vault: {e.message}",
                status,
            ) from None
        try:
            value = raw.decode()
        except UnicodeDecodeError:
            raise KeyUnavailable(
                f"secret {secret!r} of org {org_id!r} is not text; an API key must be"
            ) from None
        self._cache[(org_id, secret)] = (value, time.monotonic())
        return value

    def forget(self, org_id: str, secret: str) -> None:
        self._cache.pop((org_id, secret), None)

    def close(self) -> None:
        if self._vault is not None:
            self._vault.close()
