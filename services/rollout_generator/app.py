"""HTTP wiring of the rollout-generator."""

from __future__ import annotations

from fastapi import FastAPI

from rlnode.service import create_service_app
from rollout_generator.settings import SERVICE_NAME, GeneratorSettings


def create_app(settings: GeneratorSettings) -> FastAPI:
    return create_service_app(SERVICE_NAME, settings)
