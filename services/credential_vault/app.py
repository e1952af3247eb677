"""HTTP wiring of the credential-vault."""

from __future__ import annotations

from fastapi import FastAPI

from credential_vault.settings import SERVICE_NAME, VaultSettings
from rlnode.service import create_service_app


def create_app(settings: VaultSettings) -> FastAPI:
    return create_service_app(SERVICE_NAME, settings)
