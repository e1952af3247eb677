"""Settings of the rollout-generator, from GENERATOR_* environment variables (plus the node-wide ones)."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from rlnode.messages.topics import ROLLOUT_GENERATOR_GROUP
from rlnode.service.settings import ServiceSettings

SERVICE_NAME = "rollout-generator"


class GeneratorSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="GENERATOR_", extra="ignore")

    port: int = Field(8730, ge=0, le=65535)
    generator_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    # Base of the per-rollout inference URLs handed to Task Apps; default http://HOST:PORT.
    public_url: str | None = None

    engine: Literal["torch", "vllm"] = "torch"
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    tensor_parallel: int = Field(1, ge=1)
    max_batch_size: int = Field(32, ge=1, le=4096)
    max_wait_ms: float = Field(5.0, ge=0, le=1000)
    # With the reference model stacked on inference (GPU plan), add its logprobs to trajectories.
    reference_on_inference: bool = False
    weights_wait_s: float = Field(
        60.0, ge=0, description="How long work waits for the weights it was issued at."
    )
    probe_tolerance: float = Field(
        1e-3, gt=0, description="Max |logprob diff| of the parity probe."
    )

    concurrency: int = Field(16, ge=1, le=4096, description="Rollouts in flight at once.")
    work_group: str = ROLLOUT_GENERATOR_GROUP
    gateway_url: str = "http://127.0.0.1:8720"
    service_token: SecretStr | None = Field(None, description="A service token with rollouts:run.")
    rollout_timeout_margin_s: float = Field(30.0, ge=0)
    drain_timeout_s: float = Field(
        60.0, ge=0, description="On SIGTERM, how long in-flight rollouts may finish."
    )

    def base_url(self) -> str:
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")
