"""Settings of the rollout-generator, from GENERATOR_* environment variables (plus the node-wide ones)."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from rlnode.engine.precision import resolved_dtype
from rlnode.messages.topics import ROLLOUT_GENERATOR_GROUP
from rlnode.node.plan import INFERENCE_FRACTION
from rlnode.service.registry import GATEWAY, GENERATOR
from rlnode.service.settings import VaultClientSettings

SERVICE = GENERATOR


class GeneratorSettings(VaultClientSettings):
    model_config = SettingsConfigDict(env_prefix=SERVICE.env_prefix, extra="ignore")

    port: int = Field(SERVICE.port, ge=0, le=65535, description="HTTP port.")
    generator_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="This generator's name in trajectories and events (default host-pid).",
    )
    public_url: str | None = Field(
        None,
        description="Base of the per-rollout inference URLs handed to Task Apps (default "
        "http://HOST:PORT).",
    )

    engine: Literal["torch", "vllm", "instant"] = Field(
        "torch",
        description="torch (CPU or GPU) or vllm (imported only then); instant answers fixed "
        "tokens at once, for measuring the control plane only (make bench-control-plane).",
    )
    device: str = Field("cpu", description="Where the engine runs: cpu or cuda[:N].")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The engine's weights: auto is bfloat16 on GPUs, float32 on the CPU."
    )
    tensor_parallel: int = Field(1, ge=1, description="GPUs per vLLM engine.")
    gpu_memory_fraction: float = Field(
        INFERENCE_FRACTION,
        gt=0,
        le=0.95,
        description="vLLM: the share of each GPU's memory the policy engine may take "
        "(the GPU plan sets it when the GPU is shared).",
    )
    reference_gpu_memory_fraction: float = Field(
        0.15,
        gt=0,
        le=0.95,
        description="vLLM: the share a reference engine stacked on the same GPU may take.",
    )
    cpu_kv_cache_mib: int = Field(
        512, ge=16, description="vLLM on the CPU: the KV cache's size per engine, in MiB."
    )
    enforce_eager: bool = Field(
        False,
        description="vLLM: no torch.compile and no CUDA graphs: engines start sooner (each "
        "job's start pays it) and generate slower.",
    )
    vllm_swap: Literal["keep", "wait"] = Field(
        "keep",
        description="vLLM: how requests in flight meet a new weight version: keep (they stop "
        "where they are and go on under the new weights: generation waits only for the "
        "reload) or wait (they finish on the old weights first while new ones queue).",
    )
    vllm_lora_serving: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description="vLLM: how a LoRA job's adapters are served: adapter (vLLM's LoRA "
        "kernels), merged (into the base weights, reloaded as full weights) or auto (merged "
        "on the CPU, where vLLM's LoRA kernels generate 4.9x slower; adapter on a GPU).",
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="vLLM: the longest sequence (default: the job's model.max_seq_len, at "
        "most the model's own).",
    )
    max_batch_size: int = Field(32, ge=1, le=4096, description="Requests in one batch.")
    max_wait_ms: float = Field(
        5.0, ge=0, le=1000, description="The torch engine waits this long to fill a batch."
    )
    reference_on_inference: bool = Field(
        False,
        description="The plan stacks the reference model here: add its logprobs to trajectories.",
    )
    weights_wait_s: float = Field(
        60.0, ge=0, description="How long work waits for the weights it was issued at."
    )
    probe_tolerance: float | None = Field(
        None,
        gt=0,
        description="Max |logprob diff| of the parity probe (default: 1e-3 for a float32 "
        "engine, 0.5 for bfloat16 or float16: rounding alone moves SmolLM2's probe by 0.31 in "
        "a bf16 vLLM against the learner's fp32 pass; wrong weights move it by whole nats).",
    )
    weights_url: str | None = Field(
        None,
        description="The learner's base URL (e.g. http://learner-host:8740): a weight version "
        "whose file is not on this host is downloaded from it (GET /v1/weights/...; the "
        "service token needs weights:read). Unset: only files this host sees are loaded.",
    )
    weights_fetch: Literal["auto", "always"] = Field(
        "auto",
        description="With a weights URL: auto downloads a version only when its file is not "
        "on this host; always downloads every one.",
    )
    weights_dir: Path | None = Field(
        None,
        description="Where downloaded versions go, shared by the generators of a host: one "
        "download per version per host, each generator loading a hard link of its own "
        "(generators/<id>/<org>/<job>/v<N>.safetensors; private files). A generator's links "
        "go when it starts and stops, the host's copy once none links it. Default: "
        "rlnode-fetched in /dev/shm (memory) where that exists, else under RLNODE_DATA_DIR.",
    )
    weights_fetch_retries: int = Field(
        5,
        ge=0,
        le=100,
        description="How many times a broken download resumes (Range, from the bytes it "
        "has) before the version is refused; waits double from 0.5 s between tries.",
    )
    weights_fetch_timeout_s: float = Field(
        60.0, gt=0, description="Longest wait for the learner to connect or send more bytes."
    )

    concurrency: int = Field(16, ge=1, le=4096, description="Rollouts in flight at once.")
    tinker_samplers: int = Field(
        2,
        ge=1,
        description="Engines kept for the Tinker API's sampling sessions (one per run's "
        "weight version, or base model); the least recently used is closed for a new one.",
    )
    work_group: str = Field(
        ROLLOUT_GENERATOR_GROUP, description="The consumer group the generators share work in."
    )
    gateway_url: str = Field(
        GATEWAY.default_url,
        description="The taskapp-gateway; several, comma-separated, to spread work items over "
        "(a node's gateways: one runs the managed Task Apps, all run rollouts).",
    )
    rollout_timeout_margin_s: float = Field(
        30.0, ge=0, description="Added to a rollout's timeout for the call to the gateway."
    )
    drain_timeout_s: float = Field(
        60.0, ge=0, description="On SIGTERM, how long in-flight rollouts may finish."
    )

    @field_validator("gateway_url")
    @classmethod
    def _gateway_urls(cls, value: str) -> str:
        urls = [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
        if not urls:
            raise ValueError("name the taskapp-gateway, e.g. http://127.0.0.1:8110")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http(s) URL of a taskapp-gateway")
        return ",".join(urls)

    @field_validator("weights_url")
    @classmethod
    def _weights_url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        url = value.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} is not an http(s) URL of a learner")
        return url

    @model_validator(mode="after")
    def _fetch_needs_a_url(self) -> GeneratorSettings:
        if self.weights_fetch == "always" and self.weights_url is None:
            raise ValueError(
                "weights_fetch 'always' downloads from the learner: set GENERATOR_WEIGHTS_URL"
            )
        return self

    @property
    def engine_dtype(self) -> str:
        """The engine's weights: `dtype`, with auto resolved (bfloat16 on GPUs)."""
        return resolved_dtype(self.dtype, self.device)

    @property
    def parity_tolerance(self) -> float:
        if self.probe_tolerance is not None:
            return self.probe_tolerance
        return 1e-3 if self.engine_dtype == "float32" else 0.5

    @property
    def fetched_weights_dir(self) -> Path:
        """Where the host's generators keep the versions they downloaded
        (GENERATOR_WEIGHTS_DIR)."""
        if self.weights_dir is not None:
            return self.weights_dir
        memory = Path("/dev/shm")
        return (
            memory / "rlnode-fetched" if memory.is_dir() else self.node.data_dir / "fetched-weights"
        )

    @property
    def gateway_urls(self) -> list[str]:
        return self.gateway_url.split(",")

    def base_url(self) -> str:
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")


def safe_name(generator_id: str) -> str:
    """`generator_id` as one path component."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", generator_id).lstrip(".") or "_"
