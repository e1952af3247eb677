"""HTTP wiring of the checkpoint-server."""

from __future__ import annotations

from fastapi import FastAPI

from checkpoint_server.settings import SERVICE_NAME, CheckpointServerSettings
from rlnode.service import create_service_app


def create_app(settings: CheckpointServerSettings) -> FastAPI:
    return create_service_app(SERVICE_NAME, settings)
