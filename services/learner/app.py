"""HTTP wiring of the learner."""

from __future__ import annotations

from fastapi import FastAPI

from learner.settings import SERVICE_NAME, LearnerSettings
from rlnode.service import create_service_app


def create_app(settings: LearnerSettings) -> FastAPI:
    return create_service_app(SERVICE_NAME, settings)
