"""Settings of the checkpoint-server, from CHECKPOINT_SERVER_* environment variables (plus the
node-wide ones)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rlnode.messages.topics import CHECKPOINT_SERVER_GROUP
from rlnode.service.registry import CHECKPOINT_SERVER, GATEWAY
from rlnode.service.settings import VaultClientSettings

SERVICE = CHECKPOINT_SERVER


class CheckpointServerSettings(VaultClientSettings):
    model_config = SettingsConfigDict(env_prefix=SERVICE.env_prefix, extra="ignore")

    port: int = Field(SERVICE.port, ge=0, le=65535, description="HTTP port.")
    group_id: str = Field(
        CHECKPOINT_SERVER_GROUP,
        description="The consumer group of the index (and, with .org-events after it, of the "
        "copying of job events to the orgs' own topics).",
    )
    device: str = Field("cpu", description="Where inference runs: cpu or cuda[:N].")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Loaded checkpoints: auto is bfloat16 on GPUs, float32 on the CPU."
    )
    cache_bytes: int = Field(
        4 * 1024**3,
        ge=1,
        description="Memory for loaded checkpoints; the least recently used are unloaded.",
    )
    max_tokens: int = Field(4096, ge=1, description="Upper bound on max_tokens per request.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request has none.")
    max_batch_size: int = Field(32, ge=1, description="Requests in one batch.")
    gateway_url: str = Field(
        GATEWAY.default_url,
        description="The taskapp-gateway whose Task Apps the dashboard's node page lists.",
    )

    @property
    def org_events_group_id(self) -> str:
        """The consumer group that copies job events to the orgs' own topics (by default
        topics.ORG_EVENTS_COPIER_GROUP, the one its Kafka user may join)."""
        return f"{self.group_id}.org-events"
