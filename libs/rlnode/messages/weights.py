"""Weight versions (learner -> generators, checkpoint-server). Weights never travel
through Kafka: the record points at a file in the shared checkpoint store."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal
from urllib.parse import unquote, urlparse

from pydantic import Field, NonNegativeInt, model_validator

from rlnode.messages.base import Envelope, StrictModel
from rlnode.messages.config import LoraSpec


class ParityProbe(StrictModel):
    """Logprob of each token of a fixed sequence given the tokens before it, computed by the
    learner on these weights; a generator that loads them recomputes and compares."""

    token_ids: list[int] = Field(min_length=2)
    logprobs: list[float]

    @model_validator(mode="after")
    def _aligned(self) -> ParityProbe:
        if len(self.logprobs) != len(self.token_ids) - 1:
            raise ValueError(
                f"a probe of {len(self.token_ids)} tokens has {len(self.token_ids) - 1} "
                f"logprobs, not {len(self.logprobs)}"
            )
        return self


class WeightVersion(Envelope):
    SCHEMA: ClassVar[Literal["rlnode.WeightVersion/2"]] = "rlnode.WeightVersion/2"
    schema_: Literal["rlnode.WeightVersion/2"] = Field(SCHEMA, alias="schema")

    version: NonNegativeInt
    step: NonNegativeInt
    uri: str = Field(pattern=r"^file://", description="file:// URI in the checkpoint store.")
    blake3: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="BLAKE3 of the file (hex): hashed by the learner as it writes, checked by "
        "every reader. (/1 carried a sha256: 1 GB/s against BLAKE3's ~5 on one core.)",
    )
    format: Literal["safetensors"] = "safetensors"
    size_bytes: NonNegativeInt
    dtype: Literal["float32", "bfloat16", "float16"]
    probe: ParityProbe
    adapter: LoraSpec | None = Field(
        None,
        description="The file holds LoRA adapters (PEFT's tensor names) for the job's base "
        "model, not whole weights: engines load them as adapters (or merged into the base).",
    )

    @property
    def path(self) -> Path:
        """The weights file the `file://` URI names (not yet checked to be in the store)."""
        return Path(unquote(urlparse(self.uri).path))
