"""HTTP wiring of the taskapp-gateway."""

from __future__ import annotations

from fastapi import FastAPI

from rlnode.service import create_service_app
from taskapp_gateway.settings import SERVICE_NAME, GatewaySettings


def create_app(settings: GatewaySettings) -> FastAPI:
    return create_service_app(SERVICE_NAME, settings)
