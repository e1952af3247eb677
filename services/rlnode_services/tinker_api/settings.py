"""Settings of the tinker-api, from TINKER_API_* environment variables (plus the node-wide
ones)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rlnode.service.registry import TINKER_API
from rlnode.service.settings import VaultClientSettings

SERVICE = TINKER_API


class TinkerApiSettings(VaultClientSettings):
    model_config = SettingsConfigDict(env_prefix=SERVICE.env_prefix, extra="ignore")

    port: int = Field(SERVICE.port, ge=0, le=65535, description="HTTP port.")
    base_models: dict[str, str] = Field(
        default_factory=dict,
        description="Base models a client may name, as a JSON object: the name the client "
        "sends (e.g. HuggingFaceTB/SmolLM2-135M-Instruct) -> the model source the learner "
        "loads (a Hugging Face directory). A name not listed goes to the learner as it is, "
        "which loads it only from where LEARNER_MODEL_DIRS allows.",
    )
    long_poll_s: float = Field(
        20.0,
        gt=0,
        le=40,
        description="How long retrieve_future holds a request for a result before it answers "
        "try_again (the SDK gives up on one poll after 45 s).",
    )
    result_ttl_s: float = Field(
        3600.0, gt=0, description="How long a finished future's result is kept for its client."
    )
    generator_urls: str = Field(
        "",
        description="The rollout-generators sampling sessions are served by, comma-separated "
        "(`rlnode up` sets them); requests go round the list.",
    )
    sample_timeout_s: float = Field(
        600.0, gt=0, description="Longest a generator may take over one sample request."
    )
    max_body_bytes: int = Field(
        64 * 2**20, ge=1, description="The largest request body taken (forward_backward)."
    )

    @property
    def generator_list(self) -> list[str]:
        return [u.strip().rstrip("/") for u in self.generator_urls.split(",") if u.strip()]
